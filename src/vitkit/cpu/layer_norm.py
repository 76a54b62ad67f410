"""The LayerNorm of an accelerated model in training: it keeps its output, not its input, for the backward.

In a pre-norm block each LayerNorm feeds a linear layer (q;k;v, fc1) that keeps the norm's output y for its
weight gradient, and PyTorch's LayerNorm keeps its input x besides. `FastLayerNorm` computes its gradients
from y alone, recovering the normalised input as x^ = (y - beta) / gamma (as the memory-efficient LayerNorm of
Megatron-LM and apex does), so that x is freed: two (tokens, D) activations a block less (ViT-B/16 with
`FastMlp`: 178 instead of 204 MB for 2 images). The forward values are LayerNorm's; the gradients differ by
float rounding, larger where a gain gamma is small beside its bias beta, so where any |gamma| < GAIN_FLOOR *
max(1, |beta|) it keeps x as LayerNorm does.

Where this does not apply, `FastLayerNorm` is exactly nn.LayerNorm: no gradient wanted, not fp32 eager on the
CPU (`vitkit.cpu.private.eager_fp32_on_cpu`), no affine gain and bias, or hooks on the module.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .private import eager_fp32_on_cpu, hooked

# The smallest gain, relative to max(1, |bias|), from which x^ = (y - beta) / gamma is recovered to a few
# parts in a million (y's rounding, 6e-8 |y|, divided by |gamma|).
GAIN_FLOOR = 1e-2


class _OutputLayerNormFunction(torch.autograd.Function):
    """LayerNorm over the last dimension, keeping its output and 1/sigma for the backward pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        y, _, rstd = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
        ctx.save_for_backward(y, rstd, weight, bias)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        y, rstd, weight, bias = ctx.saved_tensors
        xhat = (y - bias) / weight
        # LayerNorm's own backward, told that its input was x^ itself (mean 0, 1/sigma 1): dL/dx^ and the
        # gain's and bias's gradients; dL/dx is dL/dx^ times 1/sigma.
        grad_xhat, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
            grad_out.contiguous(), xhat, [y.shape[-1]], torch.zeros_like(rstd), torch.ones_like(rstd), weight,
            bias, [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]])
        grad_x = grad_xhat * rstd if grad_xhat is not None else None
        return grad_x, grad_w, grad_b, None


def recoverable(weight: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether x^ = (y - bias) / weight is recovered accurately in every channel (GAIN_FLOOR)."""
    with torch.no_grad():
        return bool((weight.abs() >= GAIN_FLOOR * bias.abs().clamp_min(1.0)).all())


def affine_layer_norm(module: nn.Module) -> bool:
    """Whether `module` is a LayerNorm (PyTorch's or FastLayerNorm, not a subclass of someone else's) over the
    last dimension with a gain and a bias: what vitkit's fused LayerNorm kernels compute."""
    return (type(module) in (nn.LayerNorm, FastLayerNorm) and module.elementwise_affine
            and module.bias is not None and len(module.normalized_shape) == 1)


class FastLayerNorm(nn.LayerNorm):
    """nn.LayerNorm that keeps its output rather than its input for the backward pass (see the module
    docstring); a drop-in: the same parameters and names."""

    def _keeps_output(self, x: torch.Tensor) -> bool:
        return (
            eager_fp32_on_cpu(x)  # first: under torch.compile nothing else is traced
            and torch.is_grad_enabled()
            and self.weight is not None
            and self.bias is not None
            and len(self.normalized_shape) == 1
            and (x.requires_grad or self.weight.requires_grad or self.bias.requires_grad)
            and not hooked(self)
            and recoverable(self.weight, self.bias)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # TorchScript compiles this branch alone: LayerNorm's operator
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        if not self._keeps_output(x):
            return super().forward(x)
        return _OutputLayerNormFunction.apply(x, self.weight, self.bias, self.eps)
