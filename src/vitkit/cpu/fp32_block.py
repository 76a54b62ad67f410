"""The fp32 encoder block of `vitkit.optimize(model)` as one compiled operator on AVX-512 and AVX2 CPUs.

`torch.ops.vitkit.fp32_block` (csrc/fp32_block.cpp) computes eq. 2 and 3 for every token in one parallel
region, on vitkit's own products (csrc/fp32_gemm.h on AVX-512: the weights packed once into panels of 64
columns; csrc/fp32_gemm_avx2.h on AVX2 and FMA: panels of 16; the bias, the residual adds and GELU applied in
the product's tile) and the attention's kernels (register tiles on AVX-512): two meeting points of the threads
a block where the block run layer by layer has some fifteen, and the MLP's hidden activations kept in L2. Each
output is computed by one thread in one order, so the result does not depend on the number of threads.
`vitkit.cpu.convert.fp32_block_operators` readies a model's FusedBlocks for it (a copy of each weight in the
operator's layout, beside the PackedLinear's); each call's shape takes the operator or the layers, whichever
is faster here (vitkit.cpu.autotune; with tuning off, `fp32_block_default()`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from . import autotune
from .hardware import cpu_isa
from .int8 import block_linears
from .layer_norm import affine_layer_norm
from .packed import PackedLinear
from .private import eager_fp32_on_cpu, hooked

# The operator's panels: every layer's output width must be a multiple of this.
PANEL = 64


def operator_eligible(block: nn.Module, dtype: torch.dtype) -> bool:
    """Whether a block operator (this one, or vitkit.cpu.bf16_block's) computes this FusedBlock: PackedLinear
    layers of `dtype` whose widths are multiples of PANEL, GELU fused into fc1 (and the MLP's own activation
    the identity), no other activation, affine LayerNorms over the width."""
    layers = block_linears(block)
    if not all(type(lin) is PackedLinear and lin.dtype == dtype for lin in layers):
        return False
    qkv, proj, fc1, fc2 = layers
    return (fc1.activation == "gelu" and fc1.approximate in ("none", "tanh")
            and qkv.activation == proj.activation == fc2.activation == "none"
            and isinstance(block.mlp.act, nn.Identity)
            and all(lin.out_features % PANEL == 0 for lin in layers)
            and affine_layer_norm(block.norm1) and affine_layer_norm(block.norm2))


def fp32_block_eligible(block: nn.Module) -> bool:
    """Whether the operator computes this FusedBlock (`operator_eligible` in fp32)."""
    return operator_eligible(block, torch.float32)


def fp32_block_operands(block: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The operator's weights (each packed by `fp32_block_pack`) and biases (empty where none) of an eligible
    block's four layers."""
    layers = block_linears(block)
    packed = [torch.ops.vitkit.fp32_block_pack(lin.plain_weight) for lin in layers]
    biases = [torch.empty(0) if lin.bias is None else lin.bias for lin in layers]
    return packed, biases


def fp32_block(block: nn.Module, x: torch.Tensor, shares: int | None = None) -> torch.Tensor:
    """Eq. 2 and 3 for every token of `x` (B, T, D) of a FusedBlock readied for the operator (its
    `fp32_operands`, vitkit.cpu.convert.fp32_block_operators), through
    the operator; `shares` (default: the number of intra-op threads) cuts the work, not the result."""
    packed, biases = block.fp32_operands
    shares = torch.get_num_threads() if shares is None else shares
    return torch.ops.vitkit.fp32_block(
        x, block.norm1.weight, block.norm1.bias, block.norm1.eps, block.norm2.weight, block.norm2.bias,
        block.norm2.eps, packed, biases, block.attn.num_heads, block.attn.scale, block.mlp.fc1.approximate,
        shares)


def fp32_block_default() -> str:
    """What computes a block where nothing was timed: the operator on AVX-512 CPUs, the layers on AVX2 ones,
    where the operator must be timed faster to be taken. On 2 cores of an AVX2-only AMD EPYC (Zen 3) it made
    ViT-S/16 1.12x faster at batch 1 and ViT-B/16 0.90x as fast at batch 16 (its MLP's blocks of rows stream
    the weights again each; docs/speed.md), and the timing's margin kept it there as the default."""
    return "layers" if cpu_isa() == "avx2" else "operator"


def fp32_block_chosen(block: nn.Module, x: torch.Tensor) -> bool:
    """Whether the operator computes this call (else the block's layers one by one): fp32 tokens in eager
    mode on the CPU (not compiling, tracing or under a torch.func transform: the operator has no fake kernel
    or vmap rule), no hook on the modules it would skip, and the faster here for tokens of this shape
    (vitkit.cpu.autotune), by default `fp32_block_default()`."""
    if not eager_fp32_on_cpu(x):
        return False
    return operator_chosen(block, x, "fp32-block", fp32_block, fp32_block_default())


def operator_chosen(block: nn.Module, x: torch.Tensor, name: str,
                    operator: Callable[[nn.Module, torch.Tensor], torch.Tensor], default: str = "operator",
                    ) -> bool:
    """Whether `operator` computes this call of `block` rather than its layers: no hook on the modules it
    would skip, and the faster here for tokens of the shape and dtype of `x` (vitkit.cpu.autotune, under
    `name`), `default` ("operator" or "layers") where nothing is timed or neither is faster by the timing's
    margin. Never where gradients are wanted for `x`: the operator has no backward."""
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    if hooked(block.norm1, block.norm2, *block_linears(block)):
        return False
    B, T, D = x.shape
    shape = (B, T, D, block.attn.num_heads, block.mlp.fc1.out_features, block.mlp.fc1.approximate)

    def candidates():
        sample = torch.randn(B, T, D, generator=autotune.generator()).to(x.dtype)
        return {"operator": lambda: operator(block, sample), "layers": lambda: block.forward_layers(sample)}

    return autotune.choose(name, shape, candidates, default) == "operator"
