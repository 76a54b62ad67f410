"""The picture of where the model looks, for one image: its attention-rollout map (the method behind the
paper's Fig. 6) upsampled to the pixels and laid over the image as the model sees it (resized and cropped),
as a PNG."""

from __future__ import annotations

import io

import matplotlib
import numpy as np
import torch
from PIL import Image

from ..analysis.figures import upsample_map
from ..analysis.inputs import to_display
from ..config import ViTConfig

# The overlay's shorter side at least this many pixels: a 28x28 input is shown at 224x224.
MIN_SIDE = 224
# How much of the picture is the map's colour; the rest is the image, in grey so that the colours read.
MAP_WEIGHT = 0.55
# dark where the model attends least, bright where it attends most, as in vitkit's figures
COLORMAP = "inferno"


def overlay_png(x: torch.Tensor, rollout: torch.Tensor, cfg: ViTConfig) -> bytes:
    """`x` a model input (C, H, W), `rollout` its per-patch map (N,): the map, upsampled (bilinear) and
    stretched from its minimum to its maximum, in the inferno colour map, blended over the image in grey,
    enlarged to at least MIN_SIDE pixels a side; PNG bytes."""
    image = to_display(x, cfg)  # (H, W, C) or (H, W) in [0, 1]
    h, w = image.shape[:2]
    scale = max(1, -(-MIN_SIDE // min(h, w)))
    grey = Image.fromarray(np.rint(image * 255).astype(np.uint8)).convert("L")
    grey = grey.resize((w * scale, h * scale), Image.Resampling.BICUBIC)
    mask = upsample_map(rollout, cfg.grid_size, (h * scale, w * scale))  # (H', W'), maximum 1
    low = mask.min()
    mask = (mask - low) / (1.0 - low) if low < 1.0 else np.ones_like(mask)
    colour = matplotlib.colormaps[COLORMAP](mask)[..., :3]  # (H', W', 3) in [0, 1]
    base = np.asarray(grey, dtype=np.float64)[..., None] / 255.0
    blended = (1 - MAP_WEIGHT) * base + MAP_WEIGHT * colour
    out = io.BytesIO()
    Image.fromarray(np.rint(blended * 255).astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()
