"""Mean attention distance (the paper's Fig. 7, right, and Appendix D.7).

For each query patch, the attention-weighted mean of the pixel distances to all key patches; averaged over
the queries and over images, per head and per layer. It is the analogue of a receptive field size: the
paper finds some heads attending globally already in the lowest layers, others locally, and the distance
growing with depth.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def patch_distances(grid_size: tuple[int, int], patch_size: float) -> torch.Tensor:
    """(N, N) Euclidean distances in pixels between patch centres of a gh x gw grid, raster order."""
    gh, gw = grid_size
    rows, cols = torch.meshgrid(torch.arange(gh, dtype=torch.float64), torch.arange(gw, dtype=torch.float64),
                                indexing="ij")
    centres = torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=1) * patch_size  # (N, 2)
    return torch.cdist(centres, centres)


def attention_distance(attention: torch.Tensor, grid_size: tuple[int, int], patch_size: float,
                       num_prefix_tokens: int) -> torch.Tensor:
    """Mean attention distance of one layer, per image and head: (B, heads, T, T) -> (B, heads), pixels.

    `patch_size` is the pixels from one token's patch to the next: `cfg.patch_stride` (for a hybrid, the
    ResNet's stride times its 1-pixel patches; `cfg.patch_size` there is 1).

    The prefix (class token) rows and columns are left out, and each query's attention over the patches
    is re-normalised to sum to one before weighting the distances.
    """
    if attention.dim() != 4:
        raise ValueError(f"attention must be (B, heads, T, T), got shape {tuple(attention.shape)}")
    p = num_prefix_tokens
    gh, gw = grid_size
    if attention.shape[-1] != p + gh * gw:
        raise ValueError(f"attention over {attention.shape[-1]} tokens does not fit a {gh}x{gw} grid "
                         f"with {p} prefix token(s)")
    a = attention[:, :, p:, p:].to(torch.float64)  # (B, H, N, N): patches attending to patches
    a = a / a.sum(dim=-1, keepdim=True).clamp_min(1e-300)
    dist = patch_distances(grid_size, patch_size).to(a.device)  # (N, N)
    per_query = (a * dist).sum(dim=-1)  # (B, H, N)
    return per_query.mean(dim=-1)  # (B, H)


def mean_attention_distance(attentions: Sequence[torch.Tensor], grid_size: tuple[int, int], patch_size: float,
                            num_prefix_tokens: int) -> torch.Tensor:
    """All layers at once: a list of (B, heads, T, T) -> (layers, heads), averaged over the B images; pixels,
    with `patch_size` the token stride in pixels (`cfg.patch_stride`, see attention_distance)."""
    return torch.stack([attention_distance(a, grid_size, patch_size, num_prefix_tokens).mean(dim=0)
                        for a in attentions])
