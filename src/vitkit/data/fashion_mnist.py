"""Fashion-MNIST from its IDX files (gzip-compressed or not), downloaded from the official location and
checked against the published MD5s when it is nowhere on disk (see vitkit.data.locations)."""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np
import torch

from .download import download_file, found_or_downloaded
from .locations import candidate_folders, check_split, data_roots, download_root, warn_if_passed_over
from .tensor_dataset import TensorImageDataset

# Official location and checksums: the README of github.com/zalandoresearch/fashion-mnist ("Get the Data").
FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
FASHION_MNIST_URL_ENV = "VITKIT_FASHION_MNIST_URL"
FASHION_MNIST_MD5 = {
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
}
FASHION_MNIST_FILES = {  # split -> (images, labels), without the .gz
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
FASHION_MNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]
FASHION_MNIST_SUBFOLDERS = ("fashion-mnist", "fashion_mnist", "FashionMNIST")

# IDX type codes (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT"); only unsigned bytes occur here.
_IDX_UBYTE = 0x08


def read_idx(path: str | os.PathLike[str]) -> torch.Tensor:
    """Read an IDX file of unsigned bytes (gzip-compressed or not, told by its first bytes) as a uint8 tensor
    of the shape its header gives. Errors name the file."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:  # a bad header or CRC, a cut-off file, a corrupt stream
            raise ValueError(f"{path}: corrupt gzip data ({e})") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    dtype, ndim = raw[2], raw[3]
    if dtype != _IDX_UBYTE:
        raise ValueError(f"{path}: IDX type code 0x{dtype:02x}, only unsigned bytes (0x08) are supported")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header")
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    expected = int(np.prod(shape, dtype=np.int64))
    if len(raw) - header != expected:
        raise ValueError(f"{path}: header says shape {shape} ({expected} bytes), file has "
                         f"{len(raw) - header}")
    data = np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)
    return torch.from_numpy(data.copy())


def _find_file(folder: Path, base: str) -> Path | None:
    for name in (base + ".gz", base):
        if (folder / name).is_file():
            return folder / name
    return None


def find_fashion_mnist(split: str = "train",
                       data_dir: str | os.PathLike[str] | None = None) -> tuple[Path, Path] | None:
    """The (images, labels) IDX files of a split, from the first place that has both; None if none has."""
    split = check_split(split, "fashion-mnist")
    images_base, labels_base = FASHION_MNIST_FILES[split]
    for folder in candidate_folders(data_roots(data_dir), FASHION_MNIST_SUBFOLDERS):
        images, labels = _find_file(folder, images_base), _find_file(folder, labels_base)
        if images is not None and labels is not None:
            return images, labels
    return None


def download_fashion_mnist(
    split: str = "train",
    data_dir: str | os.PathLike[str] | None = None,
    base_url: str | None = None,
    md5s: dict[str, str] | None = None,
    progress: bool = True,
) -> tuple[Path, Path]:
    """Download a split's two files into `<download_root>/fashion-mnist/` and check their MD5s.

    `base_url` defaults to `$VITKIT_FASHION_MNIST_URL`, else the official location; `md5s` (file name -> hex
    digest) defaults to the published checksums.
    """
    split = check_split(split, "fashion-mnist")
    base_url = base_url or os.environ.get(FASHION_MNIST_URL_ENV) or FASHION_MNIST_URL
    md5s = FASHION_MNIST_MD5 if md5s is None else md5s
    folder = download_root(data_dir) / "fashion-mnist"
    paths = []
    for base in FASHION_MNIST_FILES[split]:
        name = base + ".gz"
        dest = folder / name
        if not dest.is_file():
            download_file(base_url.rstrip("/") + "/" + name, dest, md5=md5s[name], progress=progress)
        paths.append(dest)
    return paths[0], paths[1]


def load_fashion_mnist(
    split: str = "train",
    data_dir: str | os.PathLike[str] | None = None,
    download: bool = True,
    base_url: str | None = None,
    md5s: dict[str, str] | None = None,
) -> TensorImageDataset:
    """Fashion-MNIST's train (60,000) or test (10,000) split: 28x28 grey images, 10 classes."""
    split = check_split(split, "fashion-mnist")
    places = ", ".join(str(p) for p in data_roots(data_dir))
    missing = f"Fashion-MNIST ({split}) not found in {places} (nor their fashion-mnist/ sub-folders)"
    found = found_or_downloaded(find_fashion_mnist(split, data_dir), missing, download,
                                lambda: download_fashion_mnist(split, data_dir, base_url=base_url, md5s=md5s),
                                "install Debian's dataset-fashion-mnist")
    images_path, labels_path = found
    warn_if_passed_over(data_dir, FASHION_MNIST_SUBFOLDERS,
                         [(base + ".gz", base) for base in FASHION_MNIST_FILES[split]], images_path.parent,
                         f"Fashion-MNIST ({split})")
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3:
        raise ValueError(f"{images_path}: expected images (N, H, W), got shape {tuple(images.shape)}")
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise ValueError(f"{labels_path}: {tuple(labels.shape)} labels for {images.shape[0]} images in "
                         f"{images_path}")
    if labels.numel() and int(labels.max()) >= len(FASHION_MNIST_CLASSES):
        raise ValueError(f"{labels_path}: label {int(labels.max())} out of range 0-9")
    return TensorImageDataset(images.unsqueeze(1), labels, FASHION_MNIST_CLASSES,
                              name=f"fashion-mnist/{split}")
