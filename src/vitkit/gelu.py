"""GELU on vitkit's compiled CPU operator: the same function as torch's, exact or tanh, faster.

PyTorch computes the exact GELU's erf with a division, an exp and a polynomial per element, and its tanh
flavour slower still; its backward recomputes both. vitkit's operators (csrc/gelu.cpp) write GELU(x) = x/2 +
|x| E(|x|) and GELU'(x) = 1/2 + sign(x) D(|x|) with E and D as 16 polynomials of degree 5 on [0, 6], picked per
lane by one permute: about a third of the work of erf, and as exact as PyTorch's fp32 (max error ~7e-7 from the
float64 GELU against PyTorch's ~1e-6, tests/test_gelu.py). On our 2-core CPU the derivative runs 2.2-2.5x
faster than PyTorch's, the forward 1.1-1.5x (bound by memory traffic), the tanh flavour 4-5x; the ViT-S/16
training step ~1.5 % (docs/speed.md, "Session 18").

A second derivative (create_graph=True, as a gradient penalty needs) comes from PyTorch's GELU.

`GELU` is an nn.GELU (same `approximate`, same state) that uses the operators where they apply: fp32 on the CPU,
no autocast, not under torch.compile, not under torch.jit.trace (nor the legacy ONNX exporter), no torch.func
transform (vmap, grad, jacrev, jvp) or forward-mode AD (`vitkit.kernels.plain_ops_required`), and the library
built (`vitkit.kernels.gelu_available`); elsewhere, and in TorchScript, it is nn.GELU. `gelu_` writes GELU over
its input, for inference where nothing else reads the pre-activation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import eager_fp32_on_cpu, gelu_available


class _GELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, approximate: str) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.approximate = approximate
        return torch.ops.vitkit.gelu(x, approximate)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a gradient differentiable again, by PyTorch's GELU
            return torch.autograd.grad(F.gelu(x, approximate=ctx.approximate), x, grad, create_graph=True)[0], None
        return torch.ops.vitkit.gelu_backward(grad, x, ctx.approximate), None


def gelu_applies(x: torch.Tensor) -> bool:
    """Whether vitkit's GELU operators compute GELU of `x`: fp32 on the CPU, no autocast, not under
    torch.compile or torch.jit.trace, no torch.func transform or forward-mode AD, and the operators available."""
    return eager_fp32_on_cpu(x) and gelu_available()


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """F.gelu(x, approximate), differentiable in x, on vitkit's operators where `gelu_applies(x)`, else torch's."""
    if not gelu_applies(x):
        return F.gelu(x, approximate=approximate)
    if torch.is_grad_enabled() and x.requires_grad:
        return _GELU.apply(x, approximate)
    return torch.ops.vitkit.gelu(x, approximate)


def gelu_(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU written over `x` (no gradient): vitkit's operator where it applies to a contiguous `x`, else
    torch's `gelu_`."""
    if x.is_contiguous() and gelu_applies(x):
        return torch.ops.vitkit.gelu_(x, approximate)
    return torch.ops.aten.gelu_(x, approximate=approximate)


class GELU(nn.GELU):
    """nn.GELU on vitkit's operators where they apply (see `gelu`); a drop-in with the same `approximate`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # TorchScript compiles this branch alone: nn.GELU's
            return F.gelu(x, approximate=self.approximate)
        return gelu(x, self.approximate)
