"""Self-attention of an accelerated model, on vitkit's compiled CPU operator where it pays.

`qkv_attention(qkv, heads, scale)` computes what `merge_heads(F.scaled_dot_product_attention(*split_heads(qkv,
heads)))` does, softmax(q k^T * scale) v for every head, from the projection's output (B, T, 3C) to the merged
heads (B, T, C), with its gradient. The operators (csrc/attention.cpp) read q, k and v in place and write the
gradient of the whole projection at once, where PyTorch's path stacks the three head gradients into one (a
copy); they work on blocks of query rows that stay in the cache, and multiply on AVX-512 register tiles where
the CPU has them and the head width is a multiple of 16 up to 128 (every ViT preset), else with MKL's sgemm
(`sgemm_products()` forces sgemm, for comparison; docs/speed.md gives what the tiles buy). In training the
forward keeps the softmax for the backward when it is no larger than the MLP's hidden activation
(`keeps_probabilities`); on longer sequences the backward recomputes it from q, k and the saved log-sum-exp,
as flash attention does, so memory stays linear in T.

`FastAttention` is the model's `Attention` (same parameters, same function) that `vitkit.accelerate` swaps in:
its projections go through `vitkit.cpu.linear`, and the attention itself through the operator where
`qkv_attention_applies` (fp32 on the CPU, no autocast, not compiling or tracing, no torch.func transform or
forward-mode AD, no attention dropout, the operator built), else through the explicit products in training on
short sequences (`explicit_attention_is_faster`), else through PyTorch's SDPA. Under torch.compile the
operator goes into the compiled graph (its fake kernels give inductor the output shapes) where
`compiled_operator_applies`, and inductor fuses the elementwise work around it. Under bf16 autocast on the
CPU, and in a model cast to bf16 (`optimize(model, "bf16")`), the operator may take the projection cast to
fp32, as the model's `explicit_attention` computes the attention in fp32 there: the timing decides (with 26
tokens of 4 heads of 16, the fashion-mnist recipe's, the bf16 training step runs about 1.15x faster on it on
an Intel Xeon with AMX); without gradients, on CPUs with AVX512-BF16, the operator computes in bf16 on its
tiles there (`attention_forward_bf16`: vdpbf16ps, two multiply-adds a lane per instruction; the projection
read and the output written in bf16, no casts). Results
differ from PyTorch's only by float rounding. A second derivative (create_graph=True) comes from PyTorch's
operators (`differentiable_gradient`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..attention import Attention, autocast_off, explicit_attention, merge_heads, split_heads
from . import autotune
from .build import attention_available
from .linear import linear
from .private import constant_under_compile, eager_bf16_on_cpu, eager_fp32_on_cpu, forward_ad_may_be_on

_sgemm_only = False


@contextlib.contextmanager
def sgemm_products() -> Iterator[None]:
    """Within the block the attention operators multiply with MKL's sgemm, not on their AVX-512 register
    tiles: the same function, another summation order, to time the two in one process (docs/speed.md gives
    what that found)."""
    global _sgemm_only
    previous, _sgemm_only = _sgemm_only, True
    try:
        yield
    finally:
        _sgemm_only = previous


class _QKVAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: torch.Tensor, heads: int, scale: float, keep_probs: bool) -> torch.Tensor:
        tiles = not _sgemm_only
        out, lse, probs = torch.ops.vitkit.attention_forward(qkv, heads, scale, keep_probs, tiles)
        ctx.save_for_backward(qkv, out, lse, probs)
        ctx.heads, ctx.scale, ctx.tiles = heads, scale, tiles
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        qkv, out, lse, probs = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True: a gradient differentiable again, by PyTorch's operators
            return differentiable_gradient(qkv, grad_out, ctx.heads, ctx.scale), None, None, None
        grad = torch.ops.vitkit.attention_backward(grad_out, qkv, out, lse, probs, ctx.heads, ctx.scale,
                                                   ctx.tiles)
        return grad, None, None, None


def differentiable_gradient(qkv: torch.Tensor, grad_out: torch.Tensor, heads: int,
                            scale: float) -> torch.Tensor:
    """The attention's gradient in qkv through PyTorch's operators (the explicit softmax), itself
    differentiable: what a second derivative (create_graph=True, e.g. a gradient penalty) needs; the operators
    have none."""
    q, k, v = split_heads(qkv, heads)
    out = merge_heads(torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v)
    return torch.autograd.grad(out, qkv, grad_out, create_graph=True)[0]


def keeps_probabilities(tokens: int, head_dim: int) -> bool:
    """Whether training keeps the softmax (B, heads, T, T) for the backward instead of recomputing it from q,
    k and the log-sum-exp: when it is no larger than the MLP's hidden activation (B, T, 4C), which training
    keeps anyway, i.e. T <= 4 head_dim (ViT-S/16 and ViT-B/16 at 224 px, 197 tokens: yes; at 384 px, 577:
    no)."""
    return tokens <= 4 * head_dim


@functools.cache
def _register_fake_kernels() -> None:
    """The operators' output shapes and dtypes without computing them (what torch.compile traces with); once
    per process."""

    def forward(qkv, heads, scale, keep_probs, tiles=True):
        B, T, width = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        return (qkv.new_empty(B, T, width), qkv.new_empty(B, heads, T),
                qkv.new_empty(B if keep_probs else 0, heads, T, T))

    def backward(grad_out, qkv, out, lse, probs, heads, scale, tiles=True):
        return torch.empty_like(qkv)

    torch.library.register_fake("vitkit::attention_forward", forward)
    torch.library.register_fake("vitkit::attention_backward", backward)


@constant_under_compile
def operator_traceable() -> bool:
    """Whether torch.compile can put the operators in its graphs: they are available, and their fake kernels
    registered. A constant of the trace: asked while compiling, it is not traced."""
    if not attention_available():
        return False
    _register_fake_kernels()
    return True


def compiled_operator_applies(qkv: torch.Tensor, dropout: float = 0.0) -> bool:
    """Whether, under torch.compile on the CPU, the graph computes this projection's attention (B, T, 3C) on
    the operator: fp32 without autocast or bf16 under CPU autocast, no attention dropout, the operator
    traceable. inductor fuses the elementwise work around it, but its own attention on short sequences is
    small batched products it cannot fuse, slower than the operator's."""
    if not (torch.compiler.is_compiling() and qkv.device.type == "cpu" and qkv.dim() == 3 and dropout == 0.0):
        return False
    autocast = torch.is_autocast_enabled("cpu")
    if not ((qkv.dtype == torch.float32 and not autocast) or (qkv.dtype == torch.bfloat16 and autocast)):
        return False
    return operator_traceable()


def eager_on_cpu(qkv: torch.Tensor) -> bool:
    """fp32 without autocast, or bf16 (of CPU autocast or a bf16 model; the operator takes it cast to fp32),
    in eager mode on the CPU (private.eager_fp32_on_cpu, private.eager_bf16_on_cpu)."""
    return eager_fp32_on_cpu(qkv) or eager_bf16_on_cpu(qkv)


def qkv_attention_applies(qkv: torch.Tensor, dropout: float = 0.0) -> bool:
    """Whether `qkv_attention` computes the attention of this projection output (B, T, 3C): fp32 on the CPU
    without autocast, or bf16 (under CPU autocast, or of a bf16 model); not under torch.compile or
    torch.jit.trace, no torch.func transform or forward-mode AD, no attention dropout, and vitkit's operators
    available."""
    return eager_on_cpu(qkv) and qkv.dim() == 3 and dropout == 0.0 and attention_available()


def qkv_attention(qkv: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v of each head of the fused projection qkv (B, T, 3C) -> merged heads (B, T, C),
    differentiable in qkv. A bf16 projection is computed in bf16 on AVX512-BF16's tiles where they apply and
    no gradient is wanted, in eager mode (`attention_forward_bf16`), else in fp32, and the result rounded back
    to bf16. Check `qkv_attention_applies` first."""
    if qkv.dtype == torch.bfloat16:
        with autocast_off("cpu"):
            if on_bf16_tiles(qkv, heads):  # bf16 in and out, no casts: the same bits as through fp32
                return torch.ops.vitkit.attention_forward_bf16(qkv, heads, scale)
            return qkv_attention(qkv.float(), heads, scale).to(torch.bfloat16)
    qkv = qkv.contiguous()
    if torch.is_grad_enabled() and qkv.requires_grad:
        keep = keeps_probabilities(qkv.shape[1], qkv.shape[2] // (3 * heads))
        return _QKVAttention.apply(qkv, heads, scale, keep)
    return torch.ops.vitkit.attention_forward(qkv, heads, scale, False, not _sgemm_only)[0]


def on_bf16_tiles(qkv: torch.Tensor, heads: int) -> bool:
    """Whether `qkv_attention` computes this projection output (B, T, 3C) in bf16 on the tiles: bf16, no
    gradient wanted, in eager mode (under torch.compile the fp32 operator, whose fake kernels inductor has),
    and `bf16_tiles_apply` to its heads. The operators must be available (`qkv_attention_applies`)."""
    return (qkv.dtype == torch.bfloat16 and not (torch.is_grad_enabled() and qkv.requires_grad)
            and not torch.compiler.is_compiling() and bf16_tiles_apply(qkv.shape[-1] // (3 * heads)))


@functools.cache
def bf16_tiles_apply(head_dim: int) -> bool:
    """Whether `attention_forward_bf16` (the register tiles in bf16, attention_bf16.h) runs for heads of
    `head_dim` here: AVX512-BF16 and heads of 16 to 128 dims in multiples of 16. Needs the operators
    (`attention_available`)."""
    return bool(torch.ops.vitkit.attention_bf16_tiles_apply(head_dim))


# Where timing is off (vitkit.cpu.autotune) or the tensors are not fp32 on the CPU: training on the CPU,
# SDPA's fused kernel has a slow backward on short sequences (with 50 tokens of 4 heads of 16, the
# fashion-mnist recipe, the explicit product and softmax made the whole training step 1.13x faster; at 197
# tokens they are even, and the fused kernel keeps memory linear in the sequence length), so the explicit
# products up to this many tokens.
EXPLICIT_ATTENTION_MAX_TOKENS = 128
IMPLEMENTATIONS = ("sdpa", "explicit", "operator")  # PyTorch's own first


def explicit_attention_is_faster(x: torch.Tensor, training: bool) -> bool:
    """The fixed rule: whether the explicit attention beats F.scaled_dot_product_attention for tokens x (B, T,
    D)."""
    return training and x.device.type == "cpu" and x.shape[1] <= EXPLICIT_ATTENTION_MAX_TOKENS


def attend(how: str, qkv: torch.Tensor, heads: int, scale: float, dropout: float = 0.0,
           training: bool = False) -> torch.Tensor:
    """softmax(q k^T scale) v of every head of the fused projection qkv (B, T, 3C) -> (B, T, C), by `how`:
    "sdpa" (F.scaled_dot_product_attention), "explicit" (the products as written) or "operator"
    (`qkv_attention`; no dropout)."""
    if how == "operator":
        return qkv_attention(qkv, heads, scale)
    q, k, v = split_heads(qkv, heads)
    if how == "explicit":
        return merge_heads(explicit_attention(q, k, v, scale, dropout, training)[0])
    return merge_heads(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout))


def _candidates(B: int, T: int, heads: int, width: int, dropout: float, grad: bool, operator: bool,
                dtype: torch.dtype = torch.float32):
    """Each implementation of `attend` on a random projection output of this shape and dtype: forward, and
    backward where `grad`."""
    qkv = torch.randn(B, T, 3 * width, generator=autotune.generator()).to(dtype).requires_grad_(grad)
    out_grad = torch.randn(B, T, width, generator=autotune.generator()).to(dtype)
    scale = (width // heads) ** -0.5

    def call(how: str):
        if grad:
            return lambda: torch.autograd.grad(attend(how, qkv, heads, scale, dropout, True), qkv, out_grad)
        return lambda: attend(how, qkv, heads, scale)

    return {how: call(how) for how in IMPLEMENTATIONS if how != "operator" or operator}


def _forward_ad_on() -> bool:
    """forward_ad_may_be_on, not asked while torch.compile traces (it reads process state dynamo would
    guard)."""
    return not torch.compiler.is_compiling() and forward_ad_may_be_on()


def implementation(qkv: torch.Tensor, heads: int, dropout: float, training: bool) -> str:
    """How to attend over this projection output (B, T, 3C): the fastest of `IMPLEMENTATIONS` on this machine
    at this shape (vitkit.cpu.autotune) for fp32 tensors on the CPU; elsewhere, or with timing off, the fixed
    rule (the operator where it applies, in bf16 only where it computes in bf16, else the explicit products
    in training on up to EXPLICIT_ATTENTION_MAX_TOKENS tokens, else SDPA). Under torch.compile, the operator
    where `compiled_operator_applies`. Forward-mode AD takes the explicit products (SDPA's CPU kernel and the
    operator have no forward derivative)."""
    if _forward_ad_on():
        return "explicit"
    if compiled_operator_applies(qkv, dropout):
        return "operator"
    operator = qkv_attention_applies(qkv, dropout)
    bf16 = qkv.dtype == torch.bfloat16
    grad = torch.is_grad_enabled() and qkv.requires_grad
    bf16_tiles = operator and on_bf16_tiles(qkv, heads)  # the operator in bf16 on its tiles
    # Under bf16 autocast the operator is a candidate, not the default, unless it computes in bf16: the fixed
    # rule stays PyTorch's paths.
    if operator and (not bf16 or bf16_tiles):
        default = "operator"
    else:
        default = "explicit" if explicit_attention_is_faster(qkv, training) else "sdpa"
    if not eager_on_cpu(qkv) or qkv.dim() != 3:
        return default
    B, T, width = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
    shape = (B, T, heads, width // heads, dropout > 0, operator)  # a choice made with the operator needs it
    if bf16:
        shape += ("bf16-autocast" if torch.is_autocast_enabled("cpu") else "bf16",)
        shape += ("bf16-tiles",) if bf16_tiles else ()
    dtype = qkv.dtype
    return autotune.choose("attention-train" if grad else "attention", shape,
                           lambda: _candidates(B, T, heads, width, dropout, grad, operator, dtype), default)


class FastAttention(Attention):
    """The model's Attention on vitkit's CPU kernels (module docstring); a drop-in: same parameters and
    names."""

    linear = staticmethod(linear)  # `project`'s partial projections (the last block's) on vitkit's linear

    def forward(self, x: torch.Tensor, return_attention: bool = False, queries: int | None = None):
        dropout = self.attn_drop if self.training else 0.0
        if queries is None and not return_attention:
            qkv = self.qkv(x)  # (B, T, 3D)
            how = implementation(qkv, self.num_heads, dropout, self.training)
            return self.proj_drop(self.proj(attend(how, qkv, self.num_heads, self.scale, dropout,
                                                   self.training))), None
        # The weights asked for, or the last block's class-token queries: the explicit products or SDPA.
        q, k, v = self.project(x, queries)  # each (B, H, T or queries, Dh)
        if return_attention or explicit_attention_is_faster(x, self.training) or _forward_ad_on():
            y, attn = explicit_attention(q, k, v, self.scale, dropout, self.training)
            attn = attn if return_attention else None
        else:
            y, attn = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout), None
        return self.proj_drop(self.proj(merge_heads(y))), attn
