"""Images and datasets as the analyses need them: read, resized and normalised as the model expects.

These go through vitkit.data (`resolve`, `build_eval_transform`, `open_image`) where it provides them; the
small local versions below are used only while a part of it is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..config import ViTConfig


def eval_transform(cfg: ViTConfig):
    """The evaluation transform of the model `cfg`: resize, centre crop, the model's channels, normalise."""
    try:
        from ..data.transforms import build_eval_transform
    except ImportError:
        return _local_eval_transform(cfg)
    return build_eval_transform(cfg)


def _local_eval_transform(cfg: ViTConfig):
    from torchvision.transforms import InterpolationMode, v2

    h, w = cfg.image_size
    scale = 1.0 / cfg.crop_pct if cfg.crop_pct > 0 else 1.0
    resize = (round(h * scale), round(w * scale))
    steps = [
        v2.ToImage(),
        v2.Resize(resize, interpolation=InterpolationMode(cfg.interpolation), antialias=True),
        v2.CenterCrop((h, w)),
        v2.Grayscale(num_output_channels=cfg.in_chans) if cfg.in_chans in (1, 3) else v2.Identity(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean=list(cfg.mean), std=list(cfg.std)),
    ]
    if cfg.in_chans == 3:
        steps[3] = v2.RGB()
    return v2.Compose(steps)


def load_image(path: str | os.PathLike):
    """A PIL image, RGB or grey as stored; errors name the file."""
    try:
        from ..data.images import open_image
    except ImportError:
        open_image = None
    if open_image is not None:
        return open_image(path)
    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(2, "no such file", str(p))
    try:
        with Image.open(p) as im:
            im.load()
            return im.convert("RGB") if im.mode not in ("L", "RGB") else im.copy()
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{p}: not a readable image ({e})") from None


def resolve_data(data: str, split: str):
    """The dataset named by `data` (e.g. fashion-mnist, cifar10, or a folder), split train or test."""
    from ..data import resolve

    return resolve(data, split)


def to_display(x: torch.Tensor, cfg: ViTConfig):
    """A normalised model input (C, H, W) back to an (H, W, C) or (H, W) array in [0, 1] for plotting."""
    mean = torch.tensor(cfg.mean, dtype=x.dtype).view(-1, 1, 1)
    std = torch.tensor(cfg.std, dtype=x.dtype).view(-1, 1, 1)
    img = (x.detach().cpu() * std + mean).clamp(0, 1)
    return img[0].numpy() if img.shape[0] == 1 else img.permute(1, 2, 0).numpy()
