"""The LayerNorm of a bf16 model for inference on CPUs with AVX512-BF16: `torch.ops.vitkit.layer_norm_bf16`.

`optimize(model, "bf16")` turns each nn.LayerNorm into a `Bf16LayerNorm` (`bf16_layer_norms`, by changing the
module's class: the same parameters under the same names). It computes what PyTorch's bf16 LayerNorm computes,
each row's mean and variance in fp32 and the output rounded to bf16, in a kernel that reads and writes the row
once (csrc/layer_norm_bf16.cpp); the two differ by one bf16 rounding in a few outputs in a thousand, where the
fp32 sums differ in their last bits. Elsewhere (another dtype, autocast, gradients wanted, torch.compile or
TorchScript, hooks) it is nn.LayerNorm.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .build import layer_norm_bf16_available
from .layer_norm import affine_layer_norm
from .private import eager_bf16_on_cpu, hooked


class Bf16LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose bf16 inference runs on vitkit's kernel (module docstring); a drop-in."""

    def _on_kernel(self, x: torch.Tensor) -> bool:
        return (eager_bf16_on_cpu(x) and not torch.is_autocast_enabled("cpu")
                and self.weight is not None and self.bias is not None
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
                and len(self.normalized_shape) == 1 and not hooked(self))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # TorchScript compiles this branch alone: LayerNorm's operator
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        if not self._on_kernel(x):
            return super().forward(x)
        return torch.ops.vitkit.layer_norm_bf16(x, self.weight, self.bias, self.eps)


def bf16_layer_norms(model: nn.Module) -> nn.Module:
    """Make, in place, every nn.LayerNorm (or FastLayerNorm) of `model` with a gain and a bias a
    Bf16LayerNorm, where the kernel runs here (`layer_norm_bf16_available`); returns `model`."""
    if not layer_norm_bf16_available():
        return model
    for module in model.modules():
        if affine_layer_norm(module):
            module.__class__ = Bf16LayerNorm
    return model
