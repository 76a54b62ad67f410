"""Images and datasets as the analyses need them, through vitkit.data: read, resized, cropped and normalised
exactly as the model is evaluated, and turned back into displayable pixels for the figures."""

from __future__ import annotations

import os

import torch

from ..config import ViTConfig
from ..data import open_image, resolve
from ..data.transforms import build_eval_transform


def eval_transform(cfg: ViTConfig):
    """The evaluation transform of the model `cfg`: the model's channels, resize, centre crop, normalise."""
    return build_eval_transform(cfg)


def load_image(path: str | os.PathLike, cfg: ViTConfig):
    """A PIL image in the model's colour mode (grey for a 1-channel model); errors name the file."""
    return open_image(path, mode="L" if cfg.in_chans == 1 else "RGB")


def resolve_data(data: str, split: str, data_dir=None):
    """The dataset named by `data` (fashion-mnist, cifar10, cifar100, or a folder), split test, val or train;
    named datasets looked for in `data_dir` first (see vitkit.data.resolve)."""
    return resolve(data, split, data_dir)


def to_display(x: torch.Tensor, cfg: ViTConfig):
    """A normalised model input (C, H, W) back to an (H, W, C) or (H, W) array in [0, 1] for plotting."""
    mean = torch.tensor(cfg.mean, dtype=x.dtype).view(-1, 1, 1)
    std = torch.tensor(cfg.std, dtype=x.dtype).view(-1, 1, 1)
    img = (x.detach().cpu() * std + mean).clamp(0, 1)
    return img[0].numpy() if img.shape[0] == 1 else img.permute(1, 2, 0).numpy()
