"""Position-embedding maths as pure functions: the fixed 2D sin-cos table and 2D resampling (Sec. 3.2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import POSEMB_MODES, ViTConfig, int_pair


def sincos_2d(grid: tuple[int, int], dim: int, temperature: float = 10_000.0) -> torch.Tensor:
    """The fixed 2D sine-cosine table of big_vision's `posemb_sincos_2d`, shape (gh * gw, dim).

    A quarter of the channels each hold sin(y), cos(y), sin(x), cos(x) at geometrically spaced frequencies.
    """
    gh, gw = grid
    if dim % 4:
        raise ValueError(f"sincos_2d needs dim divisible by 4, got {dim}")
    y, x = torch.meshgrid(torch.arange(gh, dtype=torch.float64), torch.arange(gw, dtype=torch.float64),
                          indexing="ij")
    omega = torch.arange(dim // 4, dtype=torch.float64) / (dim // 4 - 1 if dim > 4 else 1)
    omega = 1.0 / temperature**omega
    y = y.reshape(-1, 1) * omega  # (gh*gw, dim/4)
    x = x.reshape(-1, 1) * omega
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1).float()


def sincos_position_table(grid: tuple[int, int], dim: int, num_prefix_tokens: int) -> torch.Tensor:
    """The fixed table of pos_embed='sincos-2d' (App. D.4), (1, prefix + gh * gw, dim): zero rows for the
    prefix (class) tokens, which get no position, then `sincos_2d` of the grid."""
    table = sincos_2d(grid, dim)
    return torch.cat([torch.zeros(num_prefix_tokens, dim), table]).unsqueeze(0)


def resample_pos_embed(
    pos_embed: torch.Tensor,
    old_grid: int | tuple[int, int],
    new_grid: int | tuple[int, int],
    num_prefix_tokens: int = 1,
    mode: str = "bicubic",
    antialias: bool = True,
) -> torch.Tensor:
    """2D-interpolate a position table from an old_grid to a new_grid of patches (Sec. 3.2).

    `pos_embed` is (prefix + gh * gw, D) or (1, prefix + gh * gw, D), rows in raster order; the first
    `num_prefix_tokens` rows (the class token's) are kept as they are. Returns a table of the same rank.
    Resampling to the same grid returns the input unchanged.

    `mode` is 'bicubic' or 'bilinear' on pixel areas (align_corners=False, as timm), or 'bilinear-corners':
    the paper's own code (vit_jax's checkpoint loading, `scipy.ndimage.zoom` with order 1), which maps the
    corner patches onto the corner patches (align_corners=True) and does not antialias.

    `antialias` (the default, as timm's `resample_abs_pos_embed`, so that a model fine-tuned at another size
    starts from the table timm would give it) low-pass filters when shrinking a grid; torch's antialiased
    bicubic also takes the Keys kernel with a = -0.5 (PIL's) where the plain one takes a = -0.75, in either
    direction. Antialiased bilinear upsampling is plain bilinear upsampling.
    """
    if mode not in POSEMB_MODES:
        raise ValueError(f"mode must be one of {', '.join(POSEMB_MODES)}; got {mode!r}")
    old_grid = int_pair(old_grid, "old_grid", "(rows, columns)")
    new_grid = int_pair(new_grid, "new_grid", "(rows, columns)")
    squeeze = pos_embed.dim() == 2
    table = pos_embed.unsqueeze(0) if squeeze else pos_embed
    gh, gw = old_grid
    if table.shape[1] != num_prefix_tokens + gh * gw:
        raise ValueError(
            f"position table has {table.shape[1]} rows; a {gh}x{gw} grid with {num_prefix_tokens} prefix "
            f"token(s) needs {num_prefix_tokens + gh * gw}"
        )
    if tuple(old_grid) == tuple(new_grid):
        return pos_embed
    prefix, grid = table[:, :num_prefix_tokens], table[:, num_prefix_tokens:]
    dim = grid.shape[-1]
    # (1, D, gh, gw), contiguous: torch's antialiased interpolation misreads the permuted (channels-last)
    # layout of a grid one patch wide (torch 2.14: every value wrong); it reads the others alike either way.
    grid = grid.reshape(1, gh, gw, dim).permute(0, 3, 1, 2).float().contiguous()
    if mode == "bilinear-corners":
        grid = F.interpolate(grid, size=tuple(new_grid), mode="bilinear", align_corners=True)
    else:
        grid = F.interpolate(grid, size=tuple(new_grid), mode=mode, align_corners=False, antialias=antialias)
    grid = grid.permute(0, 2, 3, 1).reshape(1, -1, dim).to(table.dtype)  # (1, gh'*gw', D)
    out = torch.cat([prefix, grid], dim=1)
    return out[0] if squeeze else out


def resample_state_dict(state: dict[str, torch.Tensor], old: ViTConfig, new: ViTConfig,
                        mode: str = "bicubic") -> dict[str, torch.Tensor]:
    """Adapt the position embedding of a state dict trained for `old` to the grid of `new` (Sec. 3.2)."""
    state = dict(state)
    if old.grid_size == new.grid_size:
        return state
    if old.pos_embed == "learned" and "pos_embed" in state:
        state["pos_embed"] = resample_pos_embed(state["pos_embed"], old.grid_size, new.grid_size,
                                                old.num_prefix_tokens, mode)
    elif old.pos_embed == "learned-2d":
        # Each half is a 1D table along its own axis: a g x 1 grid, resampled along that axis in `mode`.
        for key, axis in (("pos_embed_row", 0), ("pos_embed_col", 1)):
            g, g_new = old.grid_size[axis], new.grid_size[axis]
            state[key] = resample_pos_embed(state[key], (g, 1), (g_new, 1), num_prefix_tokens=0, mode=mode)
    return state
