"""Attention rollout (Abnar & Zuidema, 2020), the method behind the paper's attention figures (Fig. 6).

Each block mixes tokens with its attention matrix A_l, but the residual path (eq. 2) carries every token
through unchanged as well. Rollout models a block as 0.5 * (A_l + I), averaged over the heads and with rows
re-normalised, and multiplies these through the layers:

    R = Â_L Â_{L-1} ... Â_1,      Â_l = norm_rows(mean_heads(A_l) + I)

Row i of R says how much each input token contributes to token i at the output. The class token's row,
restricted to the patches, is the attention map of Fig. 6; a GAP model uses the mean of the patch tokens'
rows, since its representation is their mean (whether or not it also carries a class token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from ..config import Pool

HeadFusion = Literal["mean", "max", "min"]


def fuse_heads(attention: torch.Tensor, fusion: HeadFusion = "mean") -> torch.Tensor:
    """(B, heads, T, T) -> (B, T, T): the heads' mean (the paper's choice), max or min."""
    if attention.dim() != 4:
        raise ValueError(f"attention must be (B, heads, T, T), got shape {tuple(attention.shape)}")
    if fusion == "mean":
        return attention.mean(dim=1)
    if fusion == "max":
        return attention.amax(dim=1)
    if fusion == "min":
        return attention.amin(dim=1)
    raise ValueError(f"head fusion {fusion!r}: choose from mean, max, min")


def discard_lowest(a: torch.Tensor, ratio: float) -> torch.Tensor:
    """Zero the smallest `ratio` of each row's entries, never the diagonal (a token's path to itself).

    A common way to sharpen rollout maps: the many tiny weights add up to a haze over the background.
    """
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"discard ratio must be in [0, 1), got {ratio}")
    if ratio == 0.0:
        return a
    T = a.shape[-1]
    k = int(T * ratio)
    if k == 0:
        return a
    eye = torch.eye(T, dtype=torch.bool, device=a.device)
    ranked = a.masked_fill(eye, float("inf"))  # the diagonal is never among the smallest
    idx = ranked.topk(k, dim=-1, largest=False).indices
    return a.scatter(-1, idx, 0.0)


def rollout_matrix(attentions: Sequence[torch.Tensor], fusion: HeadFusion = "mean",
                   discard_ratio: float = 0.0, residual: bool = True) -> torch.Tensor:
    """The joint attention R = Â_L ... Â_1 of all layers, (B, T, T), from a list of (B, heads, T, T)."""
    if len(attentions) == 0:
        raise ValueError("rollout needs the attention of at least one layer")
    result = None
    for attn in attentions:
        a = fuse_heads(attn.double(), fusion)  # (B, T, T); float64 so that deep products stay exact
        a = discard_lowest(a, discard_ratio)
        if residual:
            a = a + torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)  # the residual path of eq. 2
        a = a / a.sum(dim=-1, keepdim=True)  # rows sum to one again
        result = a if result is None else a @ result  # later layers act on the mixed tokens
    return result


def _from_queries(matrix: torch.Tensor, num_prefix_tokens: int, pool: Pool | None = None) -> torch.Tensor:
    """(B, T, T) -> (B, N): the rows of the tokens the representation is read from, over the patch columns.
    pool="token": the class token's row; "gap": the mean of the patch rows (a GAP model's representation is
    the mean of the patch tokens). None: "token" if there is a prefix token, else "gap"."""
    p = num_prefix_tokens
    if pool is None:
        pool = "token" if p > 0 else "gap"
    if pool == "token":
        if p == 0:
            raise ValueError("pool='token' needs a class token, and these attention maps have no prefix "
                             "token")
        return matrix[:, 0, p:]
    if pool != "gap":
        raise ValueError(f"pool={pool!r}: choose token or gap")
    return matrix[:, p:, p:].mean(dim=1)


def attention_rollout(attentions: Sequence[torch.Tensor], num_prefix_tokens: int, fusion: HeadFusion = "mean",
                      discard_ratio: float = 0.0, pool: Pool | None = None) -> torch.Tensor:
    """Rollout from the class token (or, for a GAP model, the mean patch token) to each patch; `pool` is the
    model's (ViTConfig.pool), by default "token" when there is a prefix token.

    Returns (B, N) in patch raster order; the values are the share of the output that flows from each
    patch (the rest flows from the class token itself), float64.
    """
    return _from_queries(rollout_matrix(attentions, fusion, discard_ratio), num_prefix_tokens, pool)


def layer_attention(attentions: Sequence[torch.Tensor], layer: int, num_prefix_tokens: int,
                    head: int | None = None, pool: Pool | None = None) -> torch.Tensor:
    """One layer's raw attention to each patch, (B, N): from the class token (or the mean patch query of a
    GAP model; `pool` as in attention_rollout), averaged over the heads or from a single `head`. Negative
    indices count from the end."""
    L = len(attentions)
    if not -L <= layer < L:
        raise ValueError(f"layer {layer} out of range: the model has {L} layers (0..{L - 1})")
    attn = attentions[layer].double()
    if head is None:
        a = attn.mean(dim=1)
    else:
        H = attn.shape[1]
        if not -H <= head < H:
            raise ValueError(f"head {head} out of range: layer {layer} has {H} heads (0..{H - 1})")
        a = attn[:, head]
    return _from_queries(a, num_prefix_tokens, pool)
