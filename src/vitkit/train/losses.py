"""The classification losses a recipe trains with (`OptimConfig.loss`), on integer labels or soft targets
(MixUp/CutMix), always computed in fp32.

* 'softmax': cross-entropy of the softmax, with optional label smoothing (the fine-tuning code of the paper,
  timm, DeiT).
* 'sigmoid': one binary cross-entropy per class, summed over the classes and averaged over the batch, as the
  paper's ImageNet-21k pre-training (a multi-label dataset) used it: big_vision's `sigmoid_xent`, with the
  classifier's bias started at -10 (`OptimConfig.head_bias`) so that the first steps do not push 21k
  negatives down at once. Label smoothing spreads eps / K over the classes as it does for the softmax.
"""

from __future__ import annotations

import typing
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .settings import Loss

LOSSES = typing.get_args(Loss)  # the names OptimConfig.loss takes


def targets(y: torch.Tensor, num_classes: int, label_smoothing: float = 0.0) -> torch.Tensor:
    """(B, K) target probabilities: one-hot rows for integer labels, soft rows as they are; label smoothing
    mixes in the uniform distribution with weight `label_smoothing`."""
    t = F.one_hot(y, num_classes).float() if not y.is_floating_point() else y.float()
    return t * (1 - label_smoothing) + label_smoothing / num_classes if label_smoothing else t


def sigmoid_cross_entropy(logits: torch.Tensor, y: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Binary cross-entropy of every class's sigmoid against its target, summed over classes, mean over the
    batch."""
    t = targets(y, logits.shape[-1], label_smoothing)
    return F.binary_cross_entropy_with_logits(logits.float(), t, reduction="none").sum(-1).mean()


def classification_loss(kind: str, label_smoothing: float = 0.0) -> Callable[[torch.Tensor, torch.Tensor],
                                                                            torch.Tensor]:
    """The loss `kind` ('softmax' or 'sigmoid') as a function of (logits, labels or soft targets)."""
    if kind == "softmax":
        return lambda logits, y: F.cross_entropy(logits.float(), y, label_smoothing=label_smoothing)
    if kind == "sigmoid":
        return lambda logits, y: sigmoid_cross_entropy(logits, y, label_smoothing)
    raise ValueError(f"loss={kind!r}: choose from {', '.join(LOSSES)}")
