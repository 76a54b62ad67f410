"""Multi-head self-attention, the MSA of eq. 2 (Dosovitskiy et al., ICLR 2021; Vaswani et al. 2017): each head
softmax(q k^T / sqrt(d)) v over every token, the heads concatenated and projected. The model (vitkit.model)
builds its blocks with it; the speed-ups (vitkit.cpu) and vitkit.lsa build on its projections."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ViTConfig


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context with autocast off on `device_type` where it is on (a no-op elsewhere, e.g. on the meta
    device, which has no autocast)."""
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def split_heads(qkv: torch.Tensor, num_heads: int, parts: int = 3) -> tuple[torch.Tensor, ...]:
    """The fused q;k;v projection's output (B, T, 3D) -> q, k, v, each (B, heads, T, D / heads); with `parts`,
    any number of fused D-wide projections (B, T, parts * D) alike (parts=1: queries alone)."""
    B, T, width = qkv.shape
    return qkv.reshape(B, T, parts, num_heads, width // (parts * num_heads)).permute(2, 0, 3, 1, 4).unbind(0)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """Concatenate the heads: (B, heads, T, Dh) -> (B, T, heads * Dh)."""
    B, H, T, Dh = x.shape
    return x.transpose(1, 2).reshape(B, T, H * Dh)


class Attention(nn.Module):
    """Multi-head self-attention (MSA of eq. 2) with one fused q;k;v projection."""
    linear = staticmethod(F.linear)  # the product of `project`'s partial projections (a subclass may swap it)

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=cfg.qkv_bias)
        self.attn_drop = cfg.attn_dropout
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.proj_drop = nn.Dropout(cfg.dropout)

    def project(self, x: torch.Tensor, queries: int | None = None) -> tuple[torch.Tensor, ...]:
        """q, k, v, each (B, H, T, Dh); with `queries`, the queries of the first `queries` tokens only,
        (B, H, queries, Dh): only the keys and values are projected for every token."""
        if queries is None or not isinstance(self.qkv, nn.Linear):  # optimize's packed products: all tokens
            q, k, v = split_heads(self.qkv(x), self.num_heads)
            return (q if queries is None else q[:, :, :queries]), k, v
        w, b, D = self.qkv.weight, self.qkv.bias, self.qkv.out_features // 3  # rows: q, then k, then v
        (q,) = split_heads(self.linear(x[:, :queries], w[:D], None if b is None else b[:D]), self.num_heads,
                           parts=1)
        k, v = split_heads(self.linear(x, w[D:], None if b is None else b[D:]), self.num_heads, parts=2)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_attention: bool = False,
               scale: float | None = None, allowed: torch.Tensor | None = None):
        """softmax(q k^T / sqrt(d)) v per head: (B, H, Q, Dh), and the weights (B, H, Q, T) if asked for.
        `scale` replaces 1/sqrt(d); a bool `allowed` (Q, T) masks the scores where it is False."""
        scale = self.scale if scale is None else scale
        dropout = self.attn_drop if self.training else 0.0
        if not return_attention:
            try:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout,
                                                      scale=scale), None
            except NotImplementedError:  # forward-mode AD (torch.func.jvp): SDPA has no forward derivative
                pass
        return explicit_attention(q, k, v, scale, dropout, self.training, allowed)

    def forward(self, x: torch.Tensor, return_attention: bool = False, queries: int | None = None):
        """(B, T, D) -> (B, T, D) and the attention weights or None; with `queries`, only the first `queries`
        tokens attend (to every token): (B, queries, D)."""
        q, k, v = self.project(x, queries)  # each (B, H, T or queries, Dh)
        x, attn = self.attend(q, k, v, return_attention)
        return self.proj_drop(self.proj(merge_heads(x))), attn


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout: float = 0.0,
                       training: bool = False, allowed: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T scale) v as written, and the weights softmax(q k^T scale): the same function as
    F.scaled_dot_product_attention (with a bool `allowed` (Q, T), its attn_mask). In fp32 even under bf16
    autocast: the logits and the softmax lose accuracy in bf16."""
    dtype, wide = q.dtype, torch.promote_types(q.dtype, torch.float32)  # bf16 -> fp32; fp64 stays
    with autocast_off(q.device.type):
        q, k, v = q.to(wide), k.to(wide), v.to(wide)
        logits = (q * scale) @ k.transpose(-2, -1)  # (B, H, Q, T)
        attn = (logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))).softmax(dim=-1)
        x = (F.dropout(attn, dropout, training) @ v).to(dtype)
    return x, attn
