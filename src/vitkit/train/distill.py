"""DeiT's hard distillation (Touvron et al., ICML 2021, Sec. 4): a trained teacher's top class for each
training image teaches the student alongside the true label.

The loss is (1 - w) x the recipe's loss on the labels (smoothed, mixed) of the class head + w x the
cross-entropy of the distillation head against the teacher's top class on the same augmented image, w the
`distill_weight` (DeiT: 1/2). A student with a distillation token (`model.distilled`) has that second head;
one without uses its class head for both terms (DeiT's "hard distillation" of the class token). The teacher
runs frozen, in evaluation mode, on the student's batch brought to the teacher's own input: its pixel
normalisation and image size, so that a CNN trained at another size (a hybrid ResNet at 32 px for a ViT at
28 px) can teach.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ViTConfig

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Teacher(nn.Module):
    """A frozen classifier that gives the top class of a student's (normalised) batch."""

    def __init__(self, model: nn.Module, student: ViTConfig, num_classes: int, source: str = "the teacher"):
        super().__init__()
        cfg: ViTConfig = model.cfg
        if cfg.num_classes != num_classes:
            raise ValueError(f"teacher {source} has {cfg.num_classes} classes, the training data "
                             f"{num_classes}: a teacher must be trained on the same classes")
        if cfg.in_chans != student.in_chans:
            raise ValueError(f"teacher {source} takes {cfg.in_chans}-channel images, the student "
                             f"{student.in_chans}-channel ones")
        self.model = model.eval().requires_grad_(False)
        self.size = tuple(cfg.image_size)
        self.mode = "bicubic" if cfg.interpolation == "bicubic" else "bilinear"
        # x_teacher = (x_student * s_std + s_mean - t_mean) / t_std, per channel, as one scale and shift
        s_mean, s_std = torch.tensor(student.mean), torch.tensor(student.std)
        t_mean, t_std = torch.tensor(cfg.mean), torch.tensor(cfg.std)
        self.register_buffer("scale", (s_std / t_std).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("shift", ((s_mean - t_mean) / t_std).view(1, -1, 1, 1), persistent=False)

    def train(self, mode: bool = True) -> Teacher:  # noqa: ARG002 - a teacher stays in evaluation mode
        return super().train(False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B,) the teacher's top class for each image of the student's batch `x` (B, C, H, W)."""
        x = x * self.scale + self.shift
        if tuple(x.shape[-2:]) != self.size:
            x = F.interpolate(x, size=self.size, mode=self.mode, align_corners=False,
                              antialias=x.shape[-2] > self.size[0])
        return self.model(x).argmax(dim=-1)


def load_teacher(path: str, student: ViTConfig, num_classes: int, device: torch.device,
                 compile: bool = False) -> Teacher:
    """The teacher `path` (anything vitkit.load reads: a run's `best`, a model folder, a checkpoint); with
    `compile`, its model through torch.compile, as the student's (a BiT ResNet teacher's forward 1.7x faster
    on one thread of an AMD EPYC, batch 128, bf16 autocast)."""
    from ..loading import load
    from .one_step import compiled

    teacher = Teacher(load(path), student, num_classes, source=path).to(device)
    if compile:
        teacher.model = compiled(teacher.model, device)
    return teacher


def hard_distillation_loss(base: LossFn, weight: float) -> Callable[..., torch.Tensor]:
    """The loss of (outputs, labels, teacher's classes): outputs are (class logits, distillation logits), or
    one logits tensor for both; `base` is the recipe's loss on the labels."""

    def loss(outputs, y: torch.Tensor, teacher_classes: torch.Tensor) -> torch.Tensor:
        cls, dist = outputs if isinstance(outputs, tuple) else (outputs, outputs)
        return (1 - weight) * base(cls, y) + weight * F.cross_entropy(dist.float(), teacher_classes)

    return loss
