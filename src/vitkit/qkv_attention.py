"""Self-attention straight from the fused q;k;v projection, on vitkit's compiled CPU operator.

`qkv_attention(qkv, heads, scale)` computes what `merge_heads(F.scaled_dot_product_attention(*split_heads(qkv,
heads)))` does, softmax(q k^T * scale) v for every head, from the projection's output (B, T, 3C) to the merged
heads (B, T, C), with its gradient. The operators (csrc/attention.cpp) read q, k and v in place and write the
gradient of the whole projection at once, where PyTorch's path stacks the three head gradients into one (a
copy); their products are MKL's sgemm on blocks of query rows that stay in the cache, and the backward
recomputes the softmax from the saved log-sum-exp, as flash attention does, so memory stays linear in T.

`qkv_attention_applies(qkv, dropout)` says when: fp32 on the CPU, no autocast, not compiling, no attention
dropout, and the operators built (`vitkit.kernels.attention_available`). Elsewhere the model keeps PyTorch's own
kernels (and, in training on up to 128 tokens, the explicit products).
Results differ from PyTorch's only by float rounding (another summation order and exp).
"""

from __future__ import annotations

import torch

from .kernels import attention_available


class _QKVAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
        out, lse = torch.ops.vitkit.attention_forward(qkv, heads, scale)
        ctx.save_for_backward(qkv, out, lse)
        ctx.heads, ctx.scale = heads, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        qkv, out, lse = ctx.saved_tensors
        return torch.ops.vitkit.attention_backward(grad_out, qkv, out, lse, ctx.heads, ctx.scale), None, None


def qkv_attention_applies(qkv: torch.Tensor, dropout: float = 0.0) -> bool:
    """Whether `qkv_attention` computes the attention of this projection output (B, T, 3C): fp32 on the CPU,
    no autocast, not under torch.compile, no attention dropout, and vitkit's operators available."""
    return (
        qkv.device.type == "cpu"
        and qkv.dtype == torch.float32
        and qkv.dim() == 3
        and dropout == 0.0
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
        and attention_available()
    )


def qkv_attention(qkv: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v of each head of the fused projection qkv (B, T, 3C) -> merged heads (B, T, C),
    differentiable in qkv. Check `qkv_attention_applies` first."""
    qkv = qkv.contiguous()
    if torch.is_grad_enabled() and qkv.requires_grad:
        return _QKVAttention.apply(qkv, heads, scale)
    return torch.ops.vitkit.attention_forward(qkv, heads, scale)[0]
