"""One cell of the data-scaling study (benchmarks/study_data_scaling.py): which model, trained on how many
Fashion-MNIST images, with which seed and budget; the three models; and `run_cell`, which trains one from
scratch and measures it (top-1 on the full test set, few-shot linear evaluation of its frozen features).

The three models have about the same compute per 28x28 image (8-12 M multiply-adds, measured per cell):

- `vit`: a pure ViT, 4x4 patches (49 tokens and the class token), width 64, depth 6, 4 heads, MLP 128.
- `resnet`: vitkit's BiT ResNet (vitkit.hybrid.ResNetBackbone: weight-standardised convolutions, GroupNorm,
  the 7x7 stride-2 root and max-pool) with three stages of two bottleneck units, root width 32, then global
  average pooling and a linear head, as the BiT baselines of the paper. The backbone stands alone cleanly
  (it is the hybrid's, unchanged), so no torchvision ResNet is needed and the ResNet and the hybrid share
  their convolutional code.
- `hybrid`: the same ResNet's root and first stage (two units, stride 4: a 7x7 grid of 128 channels), cut
  into 1x1 patches for a transformer of width 64, depth 4 (Sec. 3.1).

Every cell trains the same way: AdamW (lr 2e-3, weight decay 0.05 on the weights, betas 0.9/0.999), batch
128, linear warm-up over the first tenth of the steps then cosine decay, gradient clipping at norm 1, no
augmentation and no label smoothing (the paper adds no regularisation on its smaller sets either), bf16
autocast on a GPU and where the CPU computes bf16 natively, fp32 elsewhere. The training set is a
class-balanced subset (vitkit.data.subsets.balanced_indices, seed 0: the subsets are nested and the same for
every model and seed; the seed changes the initialisation and the batch order).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from vitkit.analysis.fewshot import draw_shots, fewshot_eval
from vitkit.config import ViTConfig
from vitkit.cpu.accelerate import accelerate
from vitkit.data.fashion_mnist import load_fashion_mnist
from vitkit.data.subsets import balanced_indices, spread_indices
from vitkit.hybrid import Bottleneck, ResNetBackbone
from vitkit.model import VisionTransformer
from vitkit.train.one_step import autocast_dtype
from vitkit.train.optim import fused_adamw_supported, lr_at, param_groups, set_lr
from vitkit.train.recipes import fashion_mnist_vit

MODELS = ("vit", "resnet", "hybrid")
MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST's training set
NUM_CLASSES = 10
FEWSHOT_SHOTS = (5, 10)
FEWSHOT_DRAWS = 3  # draws of the shots, averaged (big_vision's default)
WEIGHT_DECAY = 0.05
BATCH = 128
LR = 2e-3
# The ablation variants of the ViT (the paper's Table 8 and Appendix D.3): "" is the default, a learned 1D
# position table and the class token. GAP trains at its own learning rate: the paper found that it needs a
# lower one than the class token (Fig. 9), so it runs at both.
VARIANTS = {
    "": dict(pos_embed="learned", pool="token", class_token=True, lr_scale=1.0),
    "pos-none": dict(pos_embed="none", pool="token", class_token=True, lr_scale=1.0),
    "pos-2d": dict(pos_embed="learned-2d", pool="token", class_token=True, lr_scale=1.0),
    "pos-sincos": dict(pos_embed="sincos-2d", pool="token", class_token=True, lr_scale=1.0),
    "gap": dict(pos_embed="learned", pool="gap", class_token=False, lr_scale=1.0),
    "gap-lr3": dict(pos_embed="learned", pool="gap", class_token=False, lr_scale=1 / 3),
}


@dataclass(frozen=True)
class Cell:
    """One training run of the study: `model` (MODELS) on `train_size` balanced images, for `steps` steps of
    `batch` images from `seed`; `variant` (VARIANTS, ViT only) for the ablations; `tiny` shrinks the model
    to seconds for tests."""

    model: str
    train_size: int
    seed: int
    steps: int
    batch: int = BATCH
    variant: str = ""
    tiny: bool = False

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r}: choose from {', '.join(MODELS)}")
        if self.variant not in VARIANTS or (self.variant and self.model != "vit"):
            raise ValueError(f"variant={self.variant!r}: choose from {', '.join(v for v in VARIANTS if v)} "
                             "(ViT only), or none")
        if self.train_size < NUM_CLASSES or self.steps < 1 or self.batch < 1:
            raise ValueError(f"{self}: need train_size >= {NUM_CLASSES}, steps >= 1, batch >= 1")

    @property
    def key(self) -> str:
        """The cell's name, also its record's file name: `vit-pos-2d_n60000_s1_t600`, `resnet_n1000_s0_t600`
        (`tiny-` in front for the tiny twin)."""
        name = self.model + (f"-{self.variant}" if self.variant else "")
        return f"{'tiny-' if self.tiny else ''}{name}_n{self.train_size}_s{self.seed}_t{self.steps}"

    @property
    def lr(self) -> float:
        return LR * VARIANTS[self.variant]["lr_scale"]

    def to_dict(self) -> dict:
        return asdict(self)


class ResNetClassifier(nn.Module):
    """vitkit's BiT ResNet with global average pooling and a zero-initialised linear head, with the
    VisionTransformer's `forward_features`/`forward_head` so that the study treats all models alike."""

    def __init__(self, layers: tuple[int, ...], width: int, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.backbone = ResNetBackbone(1, layers, width)
        self.head = nn.Linear(self.backbone.num_features, num_classes)
        for m in self.backbone.modules():  # as HybridEmbed.reset_parameters: He init, units start as shortcut
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, Bottleneck):
                nn.init.zeros_(m.norm3.weight)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)  # (B, C, h, w)

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        y = features.mean(dim=(2, 3))  # (B, C)
        return y if pre_logits else self.head(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def vit_config(cell: Cell) -> ViTConfig:
    """The ViT or hybrid of a cell (module docstring); tiny: width 16, one block."""
    v = VARIANTS[cell.variant]
    if cell.model == "vit":
        cfg = fashion_mnist_vit(depth=6, name="study-vit", patch=4, dim=64, mlp_dim=128)
    else:
        cfg = fashion_mnist_vit(depth=4, name="study-hybrid", patch=1, dim=64, mlp_dim=128).replace(
            hybrid_layers=(1,) if cell.tiny else (2,), hybrid_width=32)
    cfg = cfg.replace(pos_embed=v["pos_embed"], pool=v["pool"], class_token=v["class_token"])
    return cfg.replace(dim=16, depth=1, mlp_dim=32, num_heads=2) if cell.tiny else cfg


def build_model(cell: Cell) -> nn.Module:
    """The cell's model, initialised from its seed."""
    torch.manual_seed(cell.seed)
    if cell.model == "resnet":
        return ResNetClassifier((1,) if cell.tiny else (2, 2, 2), 32)
    return VisionTransformer(vit_config(cell))


def multiply_adds(model: nn.Module) -> int:
    """Multiply-adds of one 28x28 image's forward pass, counted by torch's FlopCounterMode (flops / 2)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model.eval()(torch.zeros(1, 1, 28, 28))
    return counter.get_total_flops() // 2


@dataclass(frozen=True)
class StudyData:
    """Fashion-MNIST in memory, normalised: the training split, the test split (all 10,000, or a spread
    `test_limit` for the tiny twin) and the few-shot draws from the full training split."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    @classmethod
    def load(cls, test_limit: int = 0) -> StudyData:
        train, test = load_fashion_mnist("train"), load_fashion_mnist("test")
        test_x, test_y = normalise(test.images), test.targets.long()
        if test_limit:
            rows = torch.tensor(spread_indices(len(test_y), test_limit))
            test_x, test_y = test_x[rows], test_y[rows]
        return cls(normalise(train.images), train.targets.long(), test_x, test_y)


def normalise(images: torch.Tensor) -> torch.Tensor:
    """uint8 (N, 1, 28, 28) -> float, standardised with the training set's mean and std."""
    return (images.float() / 255.0 - MEAN) / STD


def batch_order(n: int, steps: int, batch: int, seed: int) -> torch.Tensor:
    """The training rows of every step, (steps, batch): epochs of seeded permutations laid end to end, so a
    small set is visited many times within the same number of steps."""
    g = torch.Generator().manual_seed(seed)
    epochs = math.ceil(steps * batch / n)
    rows = torch.cat([torch.randperm(n, generator=g) for _ in range(epochs)])
    return rows[: steps * batch].view(steps, batch)


@torch.no_grad()
def features_and_top1(model: nn.Module, x: torch.Tensor, y: torch.Tensor | None, amp: torch.dtype | None,
                      batch: int = 1000) -> tuple[torch.Tensor, float | None]:
    """The pre-logit representations of `x` (float32, on the CPU) and, with labels, the top-1 accuracy of the
    head. `x` and `y` stay on the CPU; each batch goes to the model's device."""
    model.eval()
    device = next(model.parameters()).device
    feats, correct = [], 0
    for i in range(0, len(x), batch):
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            f = model.forward_head(model.forward_features(x[i:i + batch].to(device)), pre_logits=True)
            logits = model.head(f)
        feats.append(f.float().cpu())
        if y is not None:
            correct += int((logits.argmax(dim=1).cpu() == y[i:i + batch]).sum())
    return torch.cat(feats), (correct / len(x) if y is not None else None)


def fewshot(model: nn.Module, data: StudyData, test_feats: torch.Tensor, amp: torch.dtype | None) -> dict:
    """Few-shot linear evaluation of the frozen representation (vitkit.analysis.fewshot, the paper's
    closed-form ridge regression): FEWSHOT_SHOTS images per class drawn FEWSHOT_DRAWS times from the full
    training split (the same draws for every cell), accuracy on the test set."""
    draws = draw_shots(data.train_y, NUM_CLASSES, FEWSHOT_SHOTS, FEWSHOT_DRAWS)
    rows = np.unique(np.concatenate(list(draws.values())))
    local = {k: np.searchsorted(rows, v) for k, v in draws.items()}
    shot_feats, _ = features_and_top1(model, data.train_x[torch.as_tensor(rows)], None, amp)
    results = fewshot_eval(shot_feats, data.train_y[torch.as_tensor(rows)], test_feats, data.test_y,
                           shots=FEWSHOT_SHOTS, num_classes=NUM_CLASSES, seeds=FEWSHOT_DRAWS, draws=local)
    return {str(r.shots): {"mean": r.mean, "draws": list(r.accuracies)} for r in results}


def run_cell(cell: Cell, data: StudyData, log_every: int = 0, device: str | torch.device = "cpu") -> dict:
    """Train `cell` from scratch on `device` and measure it; returns the measurements of its record (without
    the machine and the command, which the caller adds). The model is initialised on the CPU from the cell's
    seed whatever the device, so a cell starts from the same weights everywhere; on the CPU vitkit's kernels
    are swapped in (vitkit.cpu.accelerate), on a GPU the model stays plain PyTorch."""
    device = torch.device(device)
    t0 = time.time()
    model = build_model(cell)
    macs, params = multiply_adds(model), sum(p.numel() for p in model.parameters())
    amp = autocast_dtype("bf16-native", device)
    accelerate(model.to(device))
    rows = torch.tensor(balanced_indices(data.train_y, cell.train_size, NUM_CLASSES, seed=0))
    x, y = data.train_x[rows].to(device), data.train_y[rows].to(device)
    groups = param_groups(model, WEIGHT_DECAY)
    opt = torch.optim.AdamW(groups, lr=cell.lr, weight_decay=WEIGHT_DECAY,
                            fused=fused_adamw_supported([p for g in groups for p in g["params"]]) or None)
    order = batch_order(len(rows), cell.steps, cell.batch, cell.seed).to(device)
    warmup = max(1, cell.steps // 10)
    model.train()
    losses = torch.zeros(cell.steps, device=device)  # read back every `check` steps, not every step
    check = log_every or (1 if device.type == "cpu" else 50)
    for step in range(cell.steps):
        set_lr(opt, lr_at(step, cell.steps, cell.lr, warmup))
        idx = order[step]
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            logits = model(x[idx])
        loss = F.cross_entropy(logits.float(), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses[step] = loss.detach()
        if (step + 1) % check == 0 or step + 1 == cell.steps:
            recent = losses[max(0, step + 1 - check):step + 1].cpu()
            if not torch.isfinite(recent).all():
                first = int((~torch.isfinite(recent)).nonzero()[0])
                raise RuntimeError(f"cell {cell.key}: the loss is {float(recent[first])} at step "
                                   f"{step + 1 - len(recent) + first}; lower the lr")
            if log_every:
                print(f"  {cell.key} step {step + 1}/{cell.steps} loss {float(recent.mean()):.4f}",
                      flush=True)
    losses = losses.cpu().numpy()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    train_seconds = time.time() - t0
    test_feats, top1 = features_and_top1(model, data.test_x, data.test_y, amp)
    shots = fewshot(model, data, test_feats, amp)
    return {
        "test_top1": top1, "fewshot": shots,
        "final_train_loss": float(np.mean(losses[-max(1, cell.steps // 20):])),
        "train_seconds": round(train_seconds, 1), "eval_seconds": round(time.time() - t0 - train_seconds, 1),
        "params": params, "macs_per_image": macs, "lr": cell.lr,
        "precision": "bf16" if amp is not None else "fp32", "test_images": len(data.test_y),
        "device": device.type,
    }
