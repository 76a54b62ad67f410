"""The bf16 encoder block of `optimize(model, "bf16")` as one compiled operator on CPUs with AVX512-BF16.

`torch.ops.vitkit.bf16_block` (csrc/bf16_block.cpp) is vitkit.cpu.fp32_block's operator for the bf16 model:
eq. 2 and 3 for every token in one parallel region, on vitkit's own bf16 products (csrc/bf16_gemm.h: the
weights packed once into panels of 64 columns in pairs for vdpbf16ps, sums in fp32, the bias, the residual
adds and GELU applied in the product's tile), the bf16 LayerNorm kernel and the attention's bf16 tiles. It
rounds to bf16 where the layers' fused products and LayerNorms do, so it computes what the bf16 layers compute
up to the order of the fp32 sums; the result does not depend on the number of threads.
`vitkit.cpu.convert.bf16_block_operators` readies a model's FusedBlocks for it (a copy of each weight in the
operator's layout, beside the PackedLinear's); each call's shape takes the operator or the layers, whichever
is faster here (vitkit.cpu.autotune; with tuning off, the operator).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .fp32_block import operator_chosen, operator_eligible
from .int8 import block_linears
from .private import eager_bf16_on_cpu

# The attention's bf16 tiles take heads of 16 to 128 dims, in multiples of 16.
HEAD_DIMS = range(16, 129, 16)


def bf16_block_eligible(block: nn.Module) -> bool:
    """Whether the operator computes this FusedBlock: `operator_eligible` in bf16 (whose widths in panels of
    64 make every input width even, as the weights' pairs need), and heads the attention's bf16 tiles take
    (HEAD_DIMS)."""
    return (operator_eligible(block, torch.bfloat16)
            and block.attn.qkv.in_features // block.attn.num_heads in HEAD_DIMS
            and block.attn.qkv.in_features % block.attn.num_heads == 0)


Operands = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


def bf16_block_operands(block: nn.Module) -> Operands:
    """The operator's weights (each packed by `bf16_block_pack`), biases (fp32, empty where none) of an
    eligible block's four layers, and its LayerNorms' gains and biases in fp32 (exact: bf16 widens): copies,
    as the packed layers' weights are, made once for optimize's output, which is not meant to be edited."""
    layers = block_linears(block)
    packed = [torch.ops.vitkit.bf16_block_pack(lin.plain_weight) for lin in layers]
    biases = [torch.empty(0) if lin.bias is None else lin.bias.float() for lin in layers]
    norms = [p.detach().float() for p in (block.norm1.weight, block.norm1.bias, block.norm2.weight,
                                          block.norm2.bias)]
    return packed, biases, norms


def bf16_block(block: nn.Module, x: torch.Tensor, shares: int | None = None) -> torch.Tensor:
    """Eq. 2 and 3 for every token of `x` (B, T, D) bf16 of a FusedBlock readied for the operator (its
    `bf16_operands`, vitkit.cpu.convert.bf16_block_operators), through the operator; `shares` (default: the
    number of intra-op threads) cuts the work, not the result."""
    packed, biases, (w1, b1, w2, b2) = block.bf16_operands
    shares = torch.get_num_threads() if shares is None else shares
    return torch.ops.vitkit.bf16_block(
        x, w1, b1, block.norm1.eps, w2, b2, block.norm2.eps, packed, biases, block.attn.num_heads,
        block.attn.scale, block.mlp.fc1.approximate, shares)


def bf16_block_chosen(block: nn.Module, x: torch.Tensor) -> bool:
    """Whether the operator computes this call (else the block's layers one by one): bf16 tokens in eager
    mode on the CPU without autocast (not compiling, tracing or under a torch.func transform: the operator has
    no fake kernel or vmap rule), no hook on the modules it would skip, and the faster here for tokens of this
    shape (vitkit.cpu.autotune), the operator by default."""
    if not eager_bf16_on_cpu(x) or torch.is_autocast_enabled("cpu"):
        return False
    return operator_chosen(block, x, "bf16-block", bf16_block)
