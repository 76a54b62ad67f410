"""The conversions `vitkit.optimize` applies to a copy of a model: fused blocks, packed fp32 layers, int8."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn as nn

from ..attention import Attention
from ..model import Block, PatchEmbed, VisionTransformer
from .attention import FastAttention
from .bf16_block import bf16_block_eligible, bf16_block_operands
from .build import bf16_block_available, fp32_block_available, int8_block_available
from .fp32_block import fp32_block_eligible, fp32_block_operands
from .fused_block import FusedBlock
from .hardware import cpu_has_native_bf16
from .int8 import DynamicInt8Linear, GELUInPlace, vnni_products
from .layer_norm import affine_layer_norm
from .packed import LinearPatchEmbed, PackedLinear


def _gelu_approximate(act: nn.Module) -> Literal["none", "tanh"] | None:
    """The `approximate` of an nn.GELU, or None for any other activation (which then is not fused)."""
    if isinstance(act, nn.GELU) and act.approximate in ("none", "tanh"):
        return act.approximate  # type: ignore[return-value]
    return None


def pack_linears(model: nn.Module, batch_hint: int = 197) -> nn.Module:
    """Replace, in place, every nn.Linear of `model` by a PackedLinear; where a module has an `fc1` followed
    by an nn.GELU `act` (the model's Mlp), the GELU is fused into fc1 and `act` becomes the identity."""
    for module in list(model.modules()):
        fc1, act = getattr(module, "fc1", None), getattr(module, "act", None)
        approximate = _gelu_approximate(act) if act is not None else None
        if isinstance(fc1, nn.Linear) and approximate is not None:
            module.fc1 = PackedLinear(fc1, "gelu", approximate, batch_hint)
            module.act = nn.Identity()
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, PackedLinear(child, batch_hint=batch_hint))
    return model


def fuse_blocks(model: nn.Module) -> nn.Module:
    """Replace, in place, the encoder blocks of a VisionTransformer by FusedBlocks (with class-token pooling
    the last one ready for few queries, the class-token shortcut of vitkit.shortcut) and its patch
    convolution by a LinearPatchEmbed. The linear layers stay as they are, for pack_linears or
    quantize_linears_int8 to convert. Other models, and those with another attention (vitkit.lsa), are left
    alone."""
    blocks = getattr(model, "blocks", None)
    papers = (Attention, FastAttention)  # eq. 2's attention, plain or accelerated
    if isinstance(model, VisionTransformer) and all(type(b) is Block and type(b.attn) in papers
                                                    for b in blocks):
        shortcut = model.cfg.pool == "token"  # GAP models never call a block with `queries`
        for i, block in enumerate(blocks):
            blocks[i] = FusedBlock(block, few_queries=shortcut and i == len(blocks) - 1)
        if type(model.patch_embed) is PatchEmbed:
            model.patch_embed = LinearPatchEmbed(model.patch_embed)
    return model


def _ready_block_operator(model: nn.Module, eligible: Callable[[nn.Module], bool],
                          available: Callable[[], bool], operands: Callable[[nn.Module], tuple],
                          attribute: str) -> nn.Module:
    """Set `attribute` of every FusedBlock of `model` that `eligible` accepts to its `operands`, where the
    operator runs here (`available()`, asked only if some block is eligible: it builds the operator);
    returns `model`."""
    blocks = [m for m in model.modules() if isinstance(m, FusedBlock) and eligible(m)]
    if blocks and available():
        for block in blocks:
            setattr(block, attribute, operands(block))
    return model


def fp32_block_operators(model: nn.Module) -> nn.Module:
    """Ready, in place, every FusedBlock of `model` that the fp32 block operator computes
    (`vitkit.cpu.fp32_block`: packed fp32 layers, widths in panels of 64) for it, where it runs here (AVX-512,
    or AVX2 and FMA: `fp32_block_available`); returns `model`."""
    return _ready_block_operator(model, fp32_block_eligible, fp32_block_available, fp32_block_operands,
                                 "fp32_operands")


def bf16_block_operators(model: nn.Module) -> nn.Module:
    """Ready, in place, every FusedBlock of `model` that the bf16 block operator computes
    (`vitkit.cpu.bf16_block`: packed bf16 layers, widths in panels of 64, heads of 16 to 128 dims) for it,
    where it runs here (AVX512-BF16, `bf16_block_available`); returns `model`."""
    return _ready_block_operator(model, bf16_block_eligible, bf16_block_available, bf16_block_operands,
                                 "bf16_operands")


def int8_block_eligible(block: nn.Module) -> bool:
    """Whether `block` is a FusedBlock that torch.ops.vitkit.int8_block computes: int8 linear layers with one
    activation bit width, affine LayerNorms over the width (an accelerated model's FastLayerNorm is one in
    inference), and an in-place GELU between the MLP's layers."""
    if not isinstance(block, FusedBlock):
        return False
    attn, mlp = block.attn, block.mlp
    linears = [getattr(attn, "qkv", None), getattr(attn, "proj", None), getattr(mlp, "fc1", None),
               getattr(mlp, "fc2", None)]
    norms = [block.norm1, block.norm2]
    return (all(isinstance(lin, DynamicInt8Linear) for lin in linears)
            and len({lin.reduce_range for lin in linears}) == 1
            and isinstance(getattr(mlp, "act", None), GELUInPlace)
            and all(affine_layer_norm(n) for n in norms))


def quantize_linears_int8(model: nn.Module) -> nn.Module:
    """Replace, in place, the encoder's linear layers (`blocks.*`) by DynamicInt8Linear, the MLP's GELU by
    an in-place one, and, on CPUs with native bf16, a FusedBlock's attention matrices by bf16 ones;
    FusedBlocks then run through the compiled int8 block operator where it can be built (vitkit.cpu.build).
    The classifier stays fp32: it costs little and carries the decision. So does the patch projection of
    eq. 1 (a LinearPatchEmbed's), but where vitkit's own products run (`vnni_products`: each patch quantised
    with its own scale, which a smooth image's pixels take well): there the fp32 projection took 4 % of the
    int8 ViT-S/16's and ViT-B/16's time."""
    blocks = getattr(model, "blocks", None)
    target = blocks if isinstance(blocks, nn.Module) else model
    for module in list(target.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, DynamicInt8Linear(child))
    patch_embed = getattr(model, "patch_embed", None)
    if isinstance(patch_embed, LinearPatchEmbed) and type(patch_embed.proj) is nn.Linear and vnni_products():
        patch_embed.proj = DynamicInt8Linear(patch_embed.proj, reduce_range=False)
    for module in list(target.modules()):
        approximate = _gelu_approximate(getattr(module, "act", None))
        if isinstance(getattr(module, "fc1", None), DynamicInt8Linear) and approximate is not None:
            module.act = GELUInPlace(approximate)
        if isinstance(module, FusedBlock) and cpu_has_native_bf16():
            module.attention_dtype = torch.bfloat16
    eligible = [m for m in target.modules() if int8_block_eligible(m)]
    if eligible and int8_block_available():
        for block in eligible:
            block.int8_kernel = True
    return model
