"""The picture of the paper's Fig. 6 for one image: the input as the model sees it (resized and cropped),
weighted by its attention-rollout map upsampled to the pixels, as a PNG."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from ..analysis.figures import upsample_map
from ..analysis.inputs import to_display
from ..config import ViTConfig

# The overlay's shorter side at least this many pixels: a 28x28 input is shown at 224x224.
MIN_SIDE = 224


def overlay_png(x: torch.Tensor, rollout: torch.Tensor, cfg: ViTConfig) -> bytes:
    """`x` a model input (C, H, W), `rollout` its per-patch map (N,): the input times the map (scaled to a
    maximum of 1), enlarged to at least MIN_SIDE pixels, as PNG bytes."""
    image = to_display(x, cfg)  # (H, W, C) or (H, W) in [0, 1]
    h, w = image.shape[:2]
    scale = max(1, -(-MIN_SIDE // min(h, w)))
    big = Image.fromarray(np.rint(image * 255).astype(np.uint8)).resize((w * scale, h * scale),
                                                                         Image.Resampling.BICUBIC)
    mask = upsample_map(rollout, cfg.grid_size, (h * scale, w * scale))  # (H', W') in [0, 1]
    pixels = np.asarray(big, dtype=np.float64) / 255.0
    weighted = pixels * (mask if pixels.ndim == 2 else mask[..., None])
    out = io.BytesIO()
    Image.fromarray(np.rint(weighted * 255).astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()
