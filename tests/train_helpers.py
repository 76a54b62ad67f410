"""Shared helpers of the tests/test_train_*.py files: a small, learnable stand-in for Fashion-MNIST written
as real IDX files, so the named-dataset path (`data.name=fashion-mnist`, `data.data_dir=...`) is exercised
without the real 30 MB download."""

from __future__ import annotations

import gzip
import os
import socket
import struct
from pathlib import Path

import torch

from vitkit.data import FASHION_MNIST_CLASSES, TensorImageDataset


def synthetic_images(n: int, seed: int, size: int = 28) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 (n, 1, size, size) images and their labels: class c is a bright bar at a class-specific row and
    column band, with noise, so a tiny ViT can learn it in a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randint(0, 60, (n, 1, size, size), generator=g, dtype=torch.int64)
    band = size // 10
    for i, c in enumerate(labels.tolist()):
        images[i, 0, c * band:(c + 1) * band, :] += 150
        images[i, 0, :, (9 - c) * band:(10 - c) * band] += 40
    return images.clamp(0, 255).to(torch.uint8), labels


def synthetic_dataset(n: int, seed: int, size: int = 28) -> TensorImageDataset:
    images, labels = synthetic_images(n, seed, size)
    return TensorImageDataset(images, labels, FASHION_MNIST_CLASSES, name="synthetic")


def _write_idx(path: Path, array: torch.Tensor) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(gzip.compress(header + array.numpy().tobytes(), compresslevel=1))


def write_fake_fashion_mnist(folder: Path, n_train: int = 512, n_test: int = 256) -> Path:
    """IDX files of synthetic images under the names Fashion-MNIST uses; pass `folder` as data.data_dir."""
    folder.mkdir(parents=True, exist_ok=True)
    for n, seed, (images_name, labels_name) in (
        (n_train, 1, ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz")),
        (n_test, 2, ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")),
    ):
        images, labels = synthetic_images(n, seed)
        _write_idx(folder / images_name, images[:, 0])
        _write_idx(folder / labels_name, labels.to(torch.uint8))
    return folder


def fake_data_overrides(folder: Path) -> list[str]:
    return [f"data.data_dir={folder}", "data.download=false"]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now, for a test's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_process(rank: int, world: int, port: int) -> None:
    """This process's environment as torchrun gives a worker: process `rank` of `world` on this machine,
    meeting the others at 127.0.0.1:`port`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
