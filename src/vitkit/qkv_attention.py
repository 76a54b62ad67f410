"""Self-attention straight from the fused q;k;v projection, on vitkit's compiled CPU operator.

`qkv_attention(qkv, heads, scale)` computes what `merge_heads(F.scaled_dot_product_attention(*split_heads(qkv,
heads)))` does, softmax(q k^T * scale) v for every head, from the projection's output (B, T, 3C) to the merged
heads (B, T, C), with its gradient. The operators (csrc/attention.cpp) read q, k and v in place and write the
gradient of the whole projection at once, where PyTorch's path stacks the three head gradients into one (a
copy); they work on blocks of query rows that stay in the cache, and multiply on AVX-512 register tiles where
the CPU has them and the head width is a multiple of 16 up to 128 (every ViT preset), else with MKL's sgemm
(`sgemm_products()` forces sgemm, for comparison: benchmarks/bench_attention.py). In training the
forward keeps the softmax for the backward when it is no larger than the MLP's hidden activation
(`keeps_probabilities`: 197 tokens of 64-wide heads, ViT-S/16 at batch 8: 27.9 against 31.3 ms a layer,
forward and backward); on longer sequences the backward recomputes it from q, k and the saved log-sum-exp, as
flash attention does, so memory stays linear in T.

`qkv_attention_applies(qkv, dropout)` says when: fp32 on the CPU, no autocast, not compiling, no attention
dropout, and the operators built (`vitkit.kernels.attention_available`); not under torch.jit.trace (nor the
legacy ONNX exporter), in a torch.func transform (vmap, grad, jacrev, jvp) or with forward-mode AD
(`vitkit.kernels.plain_ops_required`). Elsewhere the model keeps PyTorch's own kernels (and, in training on up
to 128 tokens, the explicit products).
Results differ from PyTorch's only by float rounding (another summation order and exp). A second derivative
(create_graph=True) comes from PyTorch's operators (`differentiable_gradient`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .kernels import attention_available, eager_fp32_on_cpu

_sgemm_only = False


@contextlib.contextmanager
def sgemm_products() -> Iterator[None]:
    """Within the block the attention operators multiply with MKL's sgemm, not on their AVX-512 register tiles:
    the same function, another summation order; benchmarks/bench_attention.py times the two in one process."""
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
        if torch.is_grad_enabled():  # create_graph=True: a gradient differentiable again, by PyTorch's operators
            return differentiable_gradient(qkv, grad_out, ctx.heads, ctx.scale), None, None, None
        grad = torch.ops.vitkit.attention_backward(grad_out, qkv, out, lse, probs, ctx.heads, ctx.scale, ctx.tiles)
        return grad, None, None, None


def differentiable_gradient(qkv: torch.Tensor, grad_out: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """The attention's gradient in qkv through PyTorch's operators (the explicit softmax), itself differentiable:
    what a second derivative (create_graph=True, e.g. a gradient penalty) needs; the operators have none."""
    from .model import merge_heads, split_heads  # imported here: vitkit.model imports this module

    q, k, v = split_heads(qkv, heads)
    out = merge_heads(torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v)
    return torch.autograd.grad(out, qkv, grad_out, create_graph=True)[0]


def keeps_probabilities(tokens: int, head_dim: int) -> bool:
    """Whether training keeps the softmax (B, heads, T, T) for the backward instead of recomputing it from q, k
    and the log-sum-exp: when it is no larger than the MLP's hidden activation (B, T, 4C), which training keeps
    anyway, i.e. T <= 4 head_dim (ViT-S/16 and ViT-B/16 at 224 px, 197 tokens: yes; at 384 px, 577: no)."""
    return tokens <= 4 * head_dim


def qkv_attention_applies(qkv: torch.Tensor, dropout: float = 0.0) -> bool:
    """Whether `qkv_attention` computes the attention of this projection output (B, T, 3C): fp32 on the CPU,
    no autocast, not under torch.compile or torch.jit.trace, no torch.func transform or forward-mode AD, no
    attention dropout, and vitkit's operators available."""
    return eager_fp32_on_cpu(qkv) and qkv.dim() == 3 and dropout == 0.0 and attention_available()


def qkv_attention(qkv: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v of each head of the fused projection qkv (B, T, 3C) -> merged heads (B, T, C),
    differentiable in qkv. Check `qkv_attention_applies` first."""
    qkv = qkv.contiguous()
    if torch.is_grad_enabled() and qkv.requires_grad:
        keep = keeps_probabilities(qkv.shape[1], qkv.shape[2] // (3 * heads))
        return _QKVAttention.apply(qkv, heads, scale, keep)
    return torch.ops.vitkit.attention_forward(qkv, heads, scale, False, not _sgemm_only)[0]
