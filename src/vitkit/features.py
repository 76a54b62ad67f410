"""Pure helpers of VisionTransformer.forward_intermediates (timm's API, as DINO and dense-prediction heads use
it): which blocks' outputs are asked for, and a block's tokens as a feature map."""

from __future__ import annotations

from collections.abc import Sequence

import torch

OUTPUT_FORMATS = ("NCHW", "NLC")


def block_indices(indices: int | Sequence[int] | None, depth: int) -> list[int]:
    """The blocks (0-based, in order) whose outputs `indices` asks for, as timm reads it: None for every
    block, an int n for the last n, a list for those blocks (negative ones count from the end)."""
    if indices is None:
        return list(range(depth))
    if isinstance(indices, int) and not isinstance(indices, bool):
        if not 0 < indices <= depth:
            raise ValueError(f"indices={indices}: the last n blocks need 1 <= n <= {depth} (the depth)")
        return list(range(depth - indices, depth))
    chosen = set()
    for i in indices:
        j = i + depth if i < 0 else i
        if not 0 <= j < depth:
            raise ValueError(f"indices: block {i} does not exist in a model of {depth} blocks")
        chosen.add(j)
    if not chosen:
        raise ValueError("indices: an empty list asks for no block")
    return sorted(chosen)


def split_tokens(tokens: torch.Tensor, num_prefix: int, grid: tuple[int, int], output_fmt: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's tokens (B, prefix + gh gw, D) as (patch tokens, prefix tokens): the patches as a map
    (B, D, gh, gw) for 'NCHW', or as they are (B, gh gw, D) for 'NLC'; the prefix (class) tokens (B, prefix,
    D)."""
    prefix, patches = tokens[:, :num_prefix], tokens[:, num_prefix:]
    if output_fmt == "NCHW":
        gh, gw = grid
        if patches.shape[1] != gh * gw:
            raise ValueError(f"output_fmt='NCHW' needs every patch token of the {gh}x{gw} grid, got "
                             f"{patches.shape[1]} (PatchDropout in training?): use 'NLC' or eval()")
        patches = patches.reshape(patches.shape[0], gh, gw, -1).permute(0, 3, 1, 2)
    return patches, prefix
