"""The int8 encoder of `vitkit.optimize(model, "int8")`: dynamically quantised linear layers, and the whole
block as one compiled operator where it can be built, its attention on the kernel timed fastest here (without
the operator: bf16 attention matrices where the CPU has native bf16). On CPUs with AVX512-VNNI and no AMX
the products are vitkit's own (csrc/int8_gemm.h: each token quantised with its own scale, 84-86 % of
vpdpbusd's peak where fbgemm's and oneDNN's reach 67-73 %, docs/speed.md); elsewhere fbgemm's or oneDNN's.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import autotune
from .build import int8_vnni_available
from .hardware import cpu_flags, cpu_has_vnni
from .linear import rows
from .packed import Unsaved, gelu_


def int8_engines() -> tuple[str, ...]:
    """The quantized engines whose int8 products DynamicInt8Linear may use here, its default first: fbgemm
    everywhere; oneDNN too on CPUs with VNNI where PyTorch has it, first where the CPU has AMX (with its tile
    products the int8 ViT-S/16 and ViT-B/16 ran 1.07-1.47x faster than on fbgemm alone on an Intel Xeon with
    AMX: docs/speed.md). Both compute the same quantisation (to float rounding); without VNNI only fbgemm,
    whose 7-bit guard is known to hold there."""
    if not cpu_has_vnni() or "onednn" not in torch.backends.quantized.supported_engines:
        return ("fbgemm",)
    return ("onednn", "fbgemm") if "amx_int8" in cpu_flags() else ("fbgemm", "onednn")


def vnni_products() -> bool:
    """Whether DynamicInt8Linear and the int8 block multiply on vitkit's own VNNI product here: where it runs
    (`build.int8_vnni_available`) and the CPU has no AMX, whose tile products (oneDNN's) it does not use."""
    return "amx_int8" not in cpu_flags() and int8_vnni_available()


@contextlib.contextmanager
def quantized_engine(engine: str) -> Iterator[None]:
    """torch.backends.quantized.engine set to `engine` inside the block (it decides whose packed weights
    `quantized::linear_prepack` makes), restored after."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


class DynamicInt8Linear(Unsaved):
    """nn.Linear with int8 weights (symmetric, one scale per output channel) and activations quantised
    per call (asymmetric uint8, one scale per tensor; per row on vitkit's own products, below), through
    `quantized::linear_dynamic` of fbgemm or
    oneDNN: the weights are packed for each engine of `int8_engines()`, and each call's row count takes the
    faster on this machine (vitkit.cpu.autotune; with tuning off, the first engine).

    torch.ao's DynamicQuantizedLinear always uses 7-bit activations (`reduce_range=True`), a guard against
    the int16 saturation of AVX2's and AVX-512's `vpmaddubsw`. CPUs with VNNI accumulate in int32 and need no
    guard: there we use all 8 bits, which halves the activation rounding error (and is as fast). 8-bit
    activations on a CPU without VNNI are refused: fbgemm's sums would saturate (errors of the order of the
    outputs themselves).

    Where `vnni_products()` holds (and activations are 8-bit), the layer multiplies on vitkit's own product
    instead (`torch.ops.vitkit.int8_vnni_linear`): the same weights, each row of the input quantised with its
    own symmetric scale; `vnni` holds its operands (packed weight, column sums, scales, bias), else None."""

    def __init__(self, linear: nn.Linear, reduce_range: bool | None = None):
        super().__init__()
        if reduce_range is False and not cpu_has_vnni():
            raise ValueError("reduce_range=False (8-bit activations) needs a CPU with VNNI, and this one has "
                             "none: fbgemm's int16 sums would saturate; use reduce_range=True or None (the "
                             "CPU's choice)")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zero = torch.zeros_like(scale, dtype=torch.long)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantize_per_channel.*")
            qweight = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float()
        engines = int8_engines()
        engines = engines if autotune.enabled() else engines[:1]
        self.packs: dict[str, torch.ScriptObject] = {}
        for engine in engines:
            with quantized_engine(engine):
                self.packs[engine] = torch.ops.quantized.linear_prepack(qweight, bias)
        self.reduce_range = (not cpu_has_vnni()) if reduce_range is None else reduce_range
        self.vnni: tuple[torch.Tensor, ...] | None = None
        if not self.reduce_range and vnni_products():
            packed, colsum = torch.ops.vitkit.int8_vnni_pack(qweight.int_repr())
            no_bias = torch.empty(0)
            self.vnni = (packed, colsum, scale.float(), no_bias if bias is None else bias.clone())

    def packed(self, n: int) -> torch.ScriptObject:
        """The packed weights whose engine multiplies `n` rows fastest here (autotune, per shape)."""
        if len(self.packs) == 1:
            return next(iter(self.packs.values()))
        shape = (n, self.in_features, self.out_features, self.reduce_range)

        def candidates():
            sample = torch.randn(max(n, 1), self.in_features, generator=autotune.generator())
            return {engine: (lambda p=p: torch.ops.quantized.linear_dynamic(sample, p, self.reduce_range))
                    for engine, p in self.packs.items()}

        return self.packs[autotune.choose("int8-linear", shape, candidates, next(iter(self.packs)))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.vnni is not None:
            if x.shape[-1] != self.in_features:
                raise ValueError(f"{self.extra_repr()}: got inputs of {x.shape[-1]} features")
            return torch.ops.vitkit.int8_vnni_linear(x, *self.vnni)
        return torch.ops.quantized.linear_dynamic(x, self.packed(rows(x)), reduce_range=self.reduce_range)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + (x W^T + b), added into the product's fresh output (no third tensor)."""
        return self(x).add_(residual)

    def extra_repr(self) -> str:
        bits = 7 if self.reduce_range else 8
        products = ", vitkit's VNNI products" if self.vnni is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 weights, "
                f"{bits}-bit activations{products}")


class GELUInPlace(nn.Module):
    """GELU written over its input: inference only, where nothing else reads the pre-activation."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_(x, self.approximate)


def bf16_attention(qkv: torch.Tensor, num_heads: int, scale: float,
                   queries: int | None = None) -> torch.Tensor:
    """Multi-head softmax(q k^T scale) v from the fused q;k;v projection's output (B, T, 3D), in bfloat16
    through SDPA's fused CPU kernel (bf16 products, softmax accumulated in fp32, no score matrix stored). For
    the int8 model on CPUs with native bf16 (AVX512-BF16, AMX), where it runs faster than the fp32 kernel; the
    int8 model is already a different function from the fp32 one, and the agreement test covers this part
    too. The kernel reads q, k and v per head in place from the projection cast to bf16 (one copy) and writes
    the heads merged, which one more copy takes back to fp32; it computes each (image, head) pair on its own,
    so the int8 block operator, which calls it on its share of the pairs, gets the same numbers:
    (B, queries or T, D) fp32."""
    B, T, width = qkv.shape
    D, Dh = width // 3, width // (3 * num_heads)
    heads = qkv.to(torch.bfloat16).view(B, T, 3, num_heads, Dh)
    q, k, v = (heads.select(2, i).transpose(1, 2) for i in range(3))  # each (B, H, T, Dh), strided
    if queries is not None:
        q = q[:, :, :queries]
    y = F.scaled_dot_product_attention(q, k, v, scale=scale)  # (B, H, Q, Dh), stored as (B, Q, H, Dh)
    return y.transpose(1, 2).float().reshape(B, q.shape[2], D)


INT8_BLOCK_ATTENTION = ("vitkit", "vitkit-bf16", "sdpa", "sdpa-bf16")


@functools.cache
def register_tiles_apply(head_dim: int) -> bool:
    """Whether the int8 block operator's "vitkit" attention runs on vitkit's AVX-512 register tiles for heads
    of `head_dim` here, rather than on sgemm: the operator's own rule (`tiles_apply`, attention_kernels.h),
    asked once per width. Needs the operator (int8_block_available)."""
    return bool(torch.ops.vitkit.int8_block_tiles_apply(head_dim))


@functools.cache
def bf16_tiles_apply(head_dim: int) -> bool:
    """Whether the int8 block operator's "vitkit-bf16" attention (the register tiles in bf16, vdpbf16ps) can
    run for heads of `head_dim` here: AVX512-BF16 and the tiles' widths (attention_bf16.h)."""
    return bool(torch.ops.vitkit.int8_block_bf16_tiles_apply(head_dim))


def int8_block_attention(block: nn.Module, x: torch.Tensor, shares: int) -> str:
    """The attention kernel of the int8 block operator for input `x`: the fastest here of vitkit's fp32
    kernel ("vitkit", the one `accelerate` and `optimize(fp32)` run), SDPA's fused kernel in fp32 ("sdpa")
    and, on CPUs with native bf16, vitkit's kernel in bf16 ("vitkit-bf16", where AVX512-BF16 has it) and
    SDPA's in bf16 ("sdpa-bf16"), each timed on the whole block (vitkit.cpu.autotune). The default, kept
    unless another is clearly faster and taken with tuning off: "vitkit-bf16" where it runs (vdpbf16ps does
    two multiply-adds a lane: the attention about 1.5x faster than in fp32, docs/speed.md), else "vitkit"
    where its AVX-512 register tiles apply (faster than SDPA in either precision there), else SDPA in bf16
    where the CPU has it natively, else SDPA in fp32."""
    B, T, D = x.shape
    heads = block.attn.num_heads
    bf16 = block.attention_dtype == torch.bfloat16
    own_bf16 = bf16 and bf16_tiles_apply(D // heads)
    default = ("vitkit-bf16" if own_bf16 else "vitkit" if register_tiles_apply(D // heads)
               else "sdpa-bf16" if bf16 else "sdpa")
    modes = [m for m in INT8_BLOCK_ATTENTION
             if (m != "sdpa-bf16" or bf16) and (m != "vitkit-bf16" or own_bf16)]
    # the candidates are part of the key: a choice cached before a kernel existed does not hide it
    products = ("vnni",) if block_on_vnni(block) else ()
    shape = (B, T, D, heads, shares, block.attn.qkv.reduce_range, *products, *modes)

    def candidates():
        sample = torch.randn(B, T, D, generator=autotune.generator())
        return {m: (lambda m=m: int8_block(block, sample, shares, attention=m)) for m in modes}

    return autotune.choose("int8-block-attention", shape, candidates, default)


def block_linears(block: nn.Module) -> list[nn.Module]:
    """The q;k;v, projection, fc1 and fc2 layers of a FusedBlock (int8 or fp32), in that order."""
    return [block.attn.qkv, block.attn.proj, block.mlp.fc1, block.mlp.fc2]


def block_on_vnni(block: nn.Module) -> bool:
    """Whether the int8 block runs on vitkit's VNNI products (`torch.ops.vitkit.int8_block_vnni`): all four
    layers carry their operands."""
    return all(lin.vnni is not None for lin in block_linears(block))


def int8_block(block: nn.Module, x: torch.Tensor, shares: int | None = None,
               attention: str | None = None) -> torch.Tensor:
    """Eq. 2 and 3 for every token of `x` (B, T, D) of a FusedBlock whose layers are int8
    (`int8_block_eligible`) through torch.ops.vitkit.int8_block (src/vitkit/cpu/csrc): the block as one
    parallel region with two meeting points between the threads instead of one per operator. It computes what
    the operator-by-operator path computes, except that the activations' int8 scales are per thread's share of
    the tokens rather than per tensor: `shares` (default: the number of intra-op threads) sets the cut, so the
    result depends slightly on it (not on vitkit's VNNI products, `block_on_vnni`, which quantise each token
    on its own). `attention` names the attention's kernel (INT8_BLOCK_ATTENTION; default:
    `int8_block_attention`'s choice). What it buys: benchmarks/bench_operators.py."""
    attn, mlp = block.attn, block.mlp
    shares = torch.get_num_threads() if shares is None else shares
    if attention is None:
        attention = int8_block_attention(block, x, shares)
    elif attention not in INT8_BLOCK_ATTENTION:
        raise ValueError(f"attention={attention!r}: the int8 block's attention is one of "
                         f"{INT8_BLOCK_ATTENTION}")
    if block_on_vnni(block):
        operands = list(zip(*(lin.vnni for lin in block_linears(block)), strict=True))
        return torch.ops.vitkit.int8_block_vnni(
            x, block.norm1.weight, block.norm1.bias, block.norm1.eps, block.norm2.weight, block.norm2.bias,
            block.norm2.eps, *operands, attn.num_heads, attn.scale, attention, mlp.act.approximate, shares)
    share = math.ceil(x.shape[0] * x.shape[1] / shares)  # each share's rows, for the choice of engine
    packs = [lin.packed(share) for lin in block_linears(block)]
    return torch.ops.vitkit.int8_block(
        x, block.norm1.weight, block.norm1.bias, block.norm1.eps, block.norm2.weight, block.norm2.bias,
        block.norm2.eps, *packs, attn.qkv.reduce_range, attn.num_heads, attn.scale, attention,
        mlp.act.approximate, shares)
