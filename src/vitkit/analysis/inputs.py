"""Images as the analyses need them: read in the model's colour mode (through vitkit.data, which also gives
the datasets and the evaluation transform), and turned back into displayable pixels for the figures."""

from __future__ import annotations

import os

import torch

from ..config import ViTConfig
from ..data import open_image


def load_image(path: str | os.PathLike, cfg: ViTConfig):
    """A PIL image in the model's colour mode (grey for a 1-channel model); errors name the file."""
    return open_image(path, mode="L" if cfg.in_chans == 1 else "RGB")


def to_display(x: torch.Tensor, cfg: ViTConfig):
    """A normalised model input (C, H, W) back to an (H, W, C) or (H, W) array in [0, 1] for plotting."""
    mean = torch.tensor(cfg.mean, dtype=x.dtype).view(-1, 1, 1)
    std = torch.tensor(cfg.std, dtype=x.dtype).view(-1, 1, 1)
    img = (x.detach().cpu() * std + mean).clamp(0, 1)
    return img[0].numpy() if img.shape[0] == 1 else img.permute(1, 2, 0).numpy()
