"""The MLP of an accelerated model in training: fc2 reads GELU(h) and recomputes it in the backward pass.

Eq. 3's MLP, fc2(GELU(fc1(x))), keeps two activations of `mlp_dim` columns a token for its backward pass: the
GELU's input h (for the GELU's derivative) and fc2's input GELU(h) (for fc2's weight gradient). `FastMlp`
keeps h alone and computes GELU(h) again when the backward pass reaches fc2: one GELU more a block (about a
per cent of a training step) for a fifth of a ViT's activation memory (ViT-B/16: 2.4 of a block's 10.6 MB an
image). The forward values are those of `Mlp`, computed by the same operators; the
gradients differ from PyTorch's only by float rounding (fc2's products run on the engine `FastLinear` picks).

Where the recomputation does not apply, `FastMlp` is exactly `Mlp`: no gradient wanted, not fp32 eager on the
CPU (`vitkit.cpu.private.eager_fp32_on_cpu`), dropout active between the layers, an activation other than
nn.GELU, a layer other than nn.Linear, or hooks on the activation or fc2 (which would not see their call).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model import Mlp
from .linear import FastLinear, _onednn_linear, training_engine_for, use_onednn
from .private import eager_fp32_on_cpu, hooked


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, engine: str) -> torch.Tensor:
    """x W^T + b on `engine` ("onednn" or "mkl", as FastLinear's training products)."""
    return _onednn_linear(x, weight, bias) if engine == "onednn" else F.linear(x, weight, bias)


class _GeluLinearFunction(torch.autograd.Function):
    """GELU(h) W^T + b, keeping h (not GELU(h)) for the backward pass."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, approximate: str,
                engine: str) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        ctx.approximate, ctx.engine, ctx.has_bias = approximate, engine, bias is not None
        return _product(F.gelu(h, approximate=approximate), weight, bias, engine)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        h, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        # create_graph=True: every operator below is PyTorch's and differentiable again (oneDNN's is not)
        differentiable = torch.is_grad_enabled()
        grad_h = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            if differentiable or ctx.engine == "mkl":
                grad_a = grad_out @ weight
            else:
                grad_a = _onednn_linear(grad_out, weight.t(), None)  # dY W: a linear layer with weight W^T
            grad_h = torch.ops.aten.gelu_backward(grad_a, h, approximate=ctx.approximate)
            del grad_a
        if ctx.needs_input_grad[1]:
            a = F.gelu(h, approximate=ctx.approximate)  # the activation not kept, computed again
            grad_w = rows.t() @ a.reshape(-1, a.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = rows.sum(0)
        return grad_h, grad_w, grad_b, None, None


def gelu_linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                approximate: str = "none") -> torch.Tensor:
    """F.linear(F.gelu(h, approximate), weight, bias), keeping h alone for the gradients where fc2's product
    runs on vitkit's engines (`use_onednn`); elsewhere those two PyTorch operators."""
    if not use_onednn(h, weight):
        return F.linear(F.gelu(h, approximate=approximate), weight, bias)
    return _GeluLinearFunction.apply(h, weight, bias, approximate, training_engine_for(h, weight, bias))


class FastMlp(Mlp):
    """`Mlp` that keeps GELU's input alone for its backward pass (see the module docstring); a drop-in: the
    same submodules, parameters and names."""

    def _recomputes(self, x: torch.Tensor) -> bool:
        fc2, act = self.fc2, self.act
        return (
            eager_fp32_on_cpu(x)  # first: under torch.compile nothing else is traced
            and torch.is_grad_enabled()
            and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
            and type(act) is nn.GELU
            and type(fc2) in (nn.Linear, FastLinear)
            and (self.drop.p == 0.0 or not self.drop.training)
            and not hooked(act, fc2, self.drop)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # TorchScript compiles this branch alone: Mlp's operators
            return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))
        if not self._recomputes(x):
            return super().forward(x)
        return gelu_linear(self.fc1(x), self.fc2.weight, self.fc2.bias, self.act.approximate)
