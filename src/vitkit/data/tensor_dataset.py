"""Images held in memory as one uint8 tensor: what the Fashion-MNIST and CIFAR readers return."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset


class TensorImageDataset(Dataset):
    """Images held in memory: `images` uint8 (N, C, H, W), `targets` int64 (N,). Items are
    `(images[i], int(targets[i]))`, the image a uint8 tensor (C, H, W)."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, classes: Sequence[str], name: str = ""):
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(f"{name or 'dataset'}: images must be uint8 (N, C, H, W), got {images.dtype} "
                             f"{tuple(images.shape)}")
        if targets.shape != (images.shape[0],):
            raise ValueError(f"{name or 'dataset'}: {images.shape[0]} images but targets of shape "
                             f"{tuple(targets.shape)}")
        self.images = images
        self.targets = targets.to(torch.int64)
        self.classes = list(classes)
        self.name = name

    @property
    def num_channels(self) -> int:
        return int(self.images.shape[1])

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.targets[index])

    def __repr__(self) -> str:
        n, c, h, w = self.images.shape
        return f"{type(self).__name__}({self.name!r}, {n} images {c}x{h}x{w}, {len(self.classes)} classes)"
