"""The encoder's linear layer: an nn.Linear whose matrix products run through oneDNN on the CPU.

`Linear` is `nn.Linear` (same parameters, same names, same function) with one change of engine: for fp32
tensors on a CPU whose PyTorch build has oneDNN, the forward product x W^T + b and the backward product dY W run
through oneDNN's linear kernel (`torch.ops.mkldnn._linear_pointwise`) instead of the MKL `addmm`/`mm` that
`F.linear` calls; the weight gradient dY^T X stays an ordinary `mm`. On our AVX-512 CPU oneDNN's kernels are
10-20 % faster than MKL's on ViT shapes (docs/speed.md), which is where the training step's time goes. Products
of at most `MKL_MAX_ROWS` rows (the classifier and the last block's class-token layers at batch 1 and 2) stay
with MKL, whose matrix-vector kernels are 1.2-2x faster than oneDNN's there.

Everywhere else (CUDA, other dtypes, autocast, torch.compile tracing, builds without oneDNN) it is exactly
`F.linear`. Results differ from `F.linear` only by float rounding (another summation order).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def onednn_available() -> bool:
    """Whether this torch build can run oneDNN's linear kernel on dense fp32 weights (x86 builds with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN = onednn_available()

# Up to this many rows MKL's F.linear beats oneDNN's linear, packed or not (interleaved, 2 threads, AVX-512:
# ViT-S/16's fc1 at one row 150 against 222-230 us, its classifier 133 against 221; from 4 rows on oneDNN leads).
MKL_MAX_ROWS = 2


def rows(x: torch.Tensor) -> int:
    """The number of rows a linear layer multiplies: every dimension of `x` but the last."""
    return x.numel() // x.shape[-1] if x.dim() > 0 and x.shape[-1] > 0 else 0


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b through oneDNN; `weight` is (out, in) and may be a transposed view."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDNNLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        grad_out = grad_out.contiguous()
        if ctx.needs_input_grad[0]:
            grad_x = _onednn_linear(grad_out, weight.t(), None)  # dY W: a linear layer with weight W^T
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = rows.t() @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = rows.sum(0)
        return grad_x, grad_w, grad_b


def use_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `Linear` takes the oneDNN path for this input (fp32 on the CPU, more than MKL_MAX_ROWS rows, no
    autocast, not compiling)."""
    return (
        _ONEDNN
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() >= 2
        and rows(x) > MKL_MAX_ROWS
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    )


class Linear(nn.Linear):
    """nn.Linear through oneDNN on the CPU (see the module docstring); a drop-in: same parameters and names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not use_onednn(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad
                                        or (self.bias is not None and self.bias.requires_grad)):
            return _OneDNNLinearFunction.apply(x, self.weight, self.bias)
        return _onednn_linear(x, self.weight, self.bias)
