"""Similarity of position embeddings (the paper's Fig. 7, centre).

For every patch, the cosine similarity of its position embedding with the embeddings of all other patches,
laid out on the patch grid. A trained model learns to encode distance: nearby patches get similar
embeddings, and a row/column structure appears.
"""

from __future__ import annotations

import torch


def position_similarity(table: torch.Tensor, grid_size: tuple[int, int],
                        num_prefix_tokens: int = 0) -> torch.Tensor:
    """Cosine similarities of the patch rows of a position table, as (N, gh, gw) maps.

    `table` is (T, D) or (1, T, D) with T = num_prefix_tokens + gh * gw (the class-token row, if any, is
    dropped). Map i holds the similarity of patch i (raster order) with every patch of the grid.
    """
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"position_similarity takes a position table tensor, got {type(table).__name__}: "
                        "model.position_table() gives it for any parameterisation (a model with "
                        "pos_embed='none' has none)")
    if table.dim() == 3:
        if table.shape[0] != 1:
            raise ValueError(f"position table must be (1, T, D) or (T, D), got shape {tuple(table.shape)}")
        table = table[0]
    if table.dim() != 2:
        raise ValueError(f"position table must be (1, T, D) or (T, D), got shape {tuple(table.shape)}")
    gh, gw = grid_size
    expected = num_prefix_tokens + gh * gw
    if table.shape[0] != expected:
        raise ValueError(f"position table has {table.shape[0]} rows; a {gh}x{gw} grid with "
                         f"{num_prefix_tokens} prefix token(s) needs {expected}")
    e = table[num_prefix_tokens:].detach().to(torch.float64)  # (N, D)
    e = e / e.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return (e @ e.T).reshape(gh * gw, gh, gw)  # (N, gh, gw)
