"""Locality Self-Attention (LSA; Lee, Lee & Song, "Vision Transformer for Small-Size Datasets", 2021), the
attention half of the paper whose patch half is vitkit.spt.

Two changes to eq. 2's softmax(q k^T / sqrt(d)): the scale is learned, one per head (initialised at
1 / sqrt(d), so that training starts from the paper's attention), and no token attends to itself (the
diagonal of the score matrix is -inf before the softmax). A token's score with itself is usually its
largest, which flattens the attention of a ViT trained on little data; with it masked and the temperature
free to fall, each token attends more sharply to the others. Not in the ViT paper: `ViTConfig(lsa=True)`
opts in.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .attention import Attention
from .config import ViTConfig


def others_only(queries: int, keys: int, device: torch.device | None = None) -> torch.Tensor:
    """(queries, keys) bool, True where query token i may attend to key token j: everywhere but j == i (the
    queries are the first `queries` tokens, as Attention's `queries` argument has them)."""
    return ~torch.eye(queries, keys, dtype=torch.bool, device=device)


class LocalitySelfAttention(Attention):
    """Attention with a learned scale per head (`head_scale`, (heads,)) and each token's own score masked
    out; the same projections as Attention, so everything that reads `qkv` and `proj` reads these."""

    def __init__(self, cfg: ViTConfig):
        super().__init__(cfg)
        self.head_scale = nn.Parameter(torch.full((cfg.num_heads,), self.scale))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_attention: bool = False):
        """softmax(q k^T x head_scale, own score masked) v per head: (B, H, Q, Dh), and the weights
        (B, H, Q, T) if asked for."""
        q = q * self.head_scale.to(q.dtype).view(-1, 1, 1)
        return super().attend(q, k, v, return_attention, scale=1.0,
                              allowed=others_only(q.shape[-2], k.shape[-2], q.device))
