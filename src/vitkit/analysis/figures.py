"""Figures on top of the analyses: each takes arrays, returns a matplotlib Figure, and `save_figure` writes
a PNG sized for a README. Titles, axis labels and colour bars throughout; the Agg backend, so no screen."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from ..extras import require

matplotlib = require("matplotlib", "vitkit's figures")
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from .filters import FilterComponents, to_display  # noqa: E402

DPI = 100


def save_figure(fig: Figure, path: str | os.PathLike, dpi: int = DPI,
                name_in_folder: str = "figure.png") -> Path:
    """Write `fig` (folders created) and close it; returns the path written. The format follows the suffix
    (.png, .pdf, .svg, ...); a path without one that matplotlib knows gets .png appended, and an existing
    folder gets the figure inside it as `name_in_folder`."""
    p = Path(path)
    if p.is_dir():
        p = p / name_in_folder
    if p.suffix.lower().lstrip(".") not in fig.canvas.get_supported_filetypes():
        p = p.with_name(p.name + ".png")
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return p


def _np(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def upsample_map(values: torch.Tensor, grid_size: tuple[int, int], image_size: tuple[int, int]) -> np.ndarray:
    """A per-patch map (N,) or (gh, gw) -> (H, W), bilinear, scaled to [0, 1] by its maximum."""
    m = torch.as_tensor(values, dtype=torch.float64).reshape(1, 1, *grid_size)
    m = F.interpolate(m, size=image_size, mode="bilinear", align_corners=False)[0, 0]
    m = m.clamp_min(0)
    top = m.max()
    return _np(m / top if top > 0 else m)


def plot_attention(images: Sequence[np.ndarray], maps: Sequence[np.ndarray], grid_size: tuple[int, int],
                   titles: Sequence[str] | None = None, method: str = "attention rollout",
                   suptitle: str = "") -> Figure:
    """Fig. 6 of the paper: per image, the input, the patch-level map and the input weighted by the map.

    `images` are (H, W, 3) or (H, W) arrays in [0, 1] as the model sees them (after resizing and cropping);
    `maps` are (N,) or (gh, gw) per-patch values.
    """
    if len(images) != len(maps):
        raise ValueError(f"{len(images)} images but {len(maps)} maps")
    n = len(images)
    fig, axes = plt.subplots(n, 3, figsize=(7.5, 2.6 * n), squeeze=False)
    for i, (img, vals) in enumerate(zip(images, maps, strict=True)):
        img = np.clip(_np(img), 0, 1)
        h, w = img.shape[:2]
        grey = img.ndim == 2 or img.shape[2] == 1
        if img.ndim == 3 and img.shape[2] == 1:
            img = img[..., 0]
        coarse = _np(vals).reshape(grid_size)
        mask = upsample_map(torch.as_tensor(coarse), grid_size, (h, w))
        ax0, ax1, ax2 = axes[i]
        ax0.imshow(img, cmap="gray" if grey else None, vmin=0, vmax=1)
        ax0.set_title(titles[i] if titles else "input", fontsize=9)
        im = ax1.imshow(coarse / coarse.max() if coarse.max() > 0 else coarse, cmap="inferno", vmin=0, vmax=1,
                        extent=(0, w, h, 0), interpolation="nearest")
        ax1.set_title(f"{method} (per patch)", fontsize=9)
        cb = fig.colorbar(im, ax=ax1, fraction=0.046, pad=0.04)
        cb.set_label("relative weight", fontsize=8)
        cb.ax.tick_params(labelsize=7)
        weighted = img * mask if grey else img * mask[..., None]
        ax2.imshow(weighted, cmap="gray" if grey else None, vmin=0, vmax=1)
        ax2.set_title("input x upsampled map", fontsize=9)
        for ax in (ax0, ax1, ax2):
            ax.set_xticks([])
            ax.set_yticks([])
    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    fig.tight_layout()
    return fig


def plot_filters(pcs: FilterComponents, cols: int = 7,
                 title: str = "Patch-embedding filters: principal components"
                 ) -> Figure:
    """Fig. 7 (left): the principal components as RGB (or grey) patches, with each one's share of variance."""
    k = pcs.components.shape[0]
    rows = math.ceil(k / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.15 * cols, 1.3 * rows + 0.5), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.set_xticks([])
        ax.set_yticks([])
        if i >= k:
            ax.axis("off")
            continue
        img = _np(to_display(pcs.components[i]))
        ax.imshow(img, cmap="gray" if img.ndim == 2 else None, vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(f"{i + 1}: {100 * float(pcs.explained[i]):.1f}%", fontsize=7)
    fig.suptitle(f"{title}\n(component: share of the filters' variance)", fontsize=10)
    fig.tight_layout()
    return fig


def similarity_mosaic(sim: np.ndarray) -> np.ndarray:
    """(N, gh, gw) maps -> one (gh*(gh+1)-1, gw*(gw+1)-1) image: map i at tile (row i // gw, column i % gw),
    tiles separated by a NaN line (drawn blank)."""
    n, gh, gw = sim.shape
    out = np.full((gh * (gh + 1) - 1, gw * (gw + 1) - 1), np.nan)
    for i in range(n):
        r, c = divmod(i, gw)
        out[r * (gh + 1): r * (gh + 1) + gh, c * (gw + 1): c * (gw + 1) + gw] = sim[i]
    return out


def plot_position_similarity(sim: torch.Tensor | np.ndarray,
                             title: str = "Position embedding similarity") -> Figure:
    """Fig. 7 (centre): tile (i, j) shows the cosine similarity between the position embedding of the patch
    in row i, column j and those of all the patches."""
    s = _np(sim)
    n, gh, gw = s.shape
    mosaic = similarity_mosaic(s)
    fig, ax = plt.subplots(figsize=(5.6, 5.6 * gh / gw + 0.4))
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")  # the NaN lines between tiles
    im = ax.imshow(mosaic, cmap=cmap, vmin=-1, vmax=1, interpolation="nearest")
    step = max(1, math.ceil(max(gh, gw) / 8))  # at most ~8 tick labels per axis
    ax.set_xticks([c * (gw + 1) + (gw - 1) / 2 for c in range(0, gw, step)])
    ax.set_xticklabels([str(c + 1) for c in range(0, gw, step)], fontsize=8)
    ax.set_yticks([r * (gh + 1) + (gh - 1) / 2 for r in range(0, gh, step)])
    ax.set_yticklabels([str(r + 1) for r in range(0, gh, step)], fontsize=8)
    ax.set_xlabel("Input patch column")
    ax.set_ylabel("Input patch row")
    ax.set_title(title, fontsize=10)
    cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    cb.set_label("Cosine similarity")
    fig.tight_layout()
    return fig


def plot_attention_distance(distance: torch.Tensor | np.ndarray, reference: float | None = None,
                            title: str = "Mean attention distance") -> Figure:
    """Fig. 7 (right): every head's mean attention distance (pixels) against its layer.

    `reference`, when given, is drawn as a dashed line: the distance of uniform attention over the grid
    (the largest value a head attending everywhere equally reaches on average).
    """
    d = _np(distance)
    L, H = d.shape
    depth = np.arange(1, L + 1)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    cmap = plt.get_cmap("tab20" if H > 10 else "tab10")
    for h in range(H):
        ax.scatter(depth, d[:, h], s=18, color=cmap(h % cmap.N), label=f"head {h + 1}", zorder=3)
    ax.plot(depth, d.mean(axis=1), color="black", lw=1.2, label="mean over heads", zorder=2)
    if reference is not None:
        ax.axhline(reference, color="grey", ls="--", lw=1, label="uniform attention")
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    ax.set_xticks(depth if L <= 16 else depth[:: math.ceil(L / 12)])
    top = max(float(np.nanmax(d)), reference or 0.0)
    ax.set_ylim(0, 1.1 * top if top > 0 else 1.0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    # Outside the axes, so that no point hides behind it.
    ax.legend(fontsize=7, ncol=2 if H > 12 else 1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_fewshot(results: dict[str, Sequence[tuple[int, float, float]]],
                 title: str = "Few-shot linear evaluation") -> Figure:
    """Accuracy against shots per class: `results` maps a label to (shots, mean %, std %) triples."""
    fig, ax = plt.subplots(figsize=(4.8, 3.4))
    for label, rows in results.items():
        shots = [r[0] for r in rows]
        ax.errorbar(shots, [r[1] for r in rows], yerr=[r[2] for r in rows], marker="o", capsize=3,
                    label=label)
    ax.set_xscale("log")
    all_shots = sorted({r[0] for rows in results.values() for r in rows})
    ax.set_xticks(all_shots)
    ax.set_xticklabels([str(s) for s in all_shots])
    ax.set_xlabel("Training examples per class")
    ax.set_ylabel("Test accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
