"""CIFAR-10 and CIFAR-100 in their binary format (never the pickled Python one), downloaded from the official
location and checked against the published MD5 when they are nowhere on disk (see vitkit.data.locations)."""

from __future__ import annotations

import os
import tarfile
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from .download import DownloadError, download_file, found_or_downloaded
from .locations import candidate_folders, check_split, data_roots, download_root, warn_if_passed_over
from .tensor_dataset import TensorImageDataset

# Format (https://www.cs.toronto.edu/~kriz/cifar.html, "Binary version"): records of label byte(s) then 3072
# pixel bytes, the red, green and blue 32x32 planes in turn, each row-major.
CIFAR_PIXELS = 3 * 32 * 32
CIFAR10_FILES = {"train": [f"data_batch_{i}.bin" for i in range(1, 6)], "test": ["test_batch.bin"]}
CIFAR10_META = "batches.meta.txt"
CIFAR10_SUBFOLDERS = ("cifar-10-batches-bin", "cifar10", "cifar-10", "cifar10/cifar-10-batches-bin")
CIFAR100_FILES = {"train": ["train.bin"], "test": ["test.bin"]}
CIFAR100_META = {"fine": "fine_label_names.txt", "coarse": "coarse_label_names.txt"}
CIFAR100_SUBFOLDERS = ("cifar-100-binary", "cifar100", "cifar-100", "cifar100/cifar-100-binary")
# The archives of the binary version and their MD5s, from the table on https://www.cs.toronto.edu/~kriz/cifar.html;
# name -> (archive, md5, the folder it unpacks to).
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/"
CIFAR_URL_ENV = "VITKIT_CIFAR_URL"
CIFAR_ARCHIVES = {
    "cifar10": ("cifar-10-binary.tar.gz", "c32a1d4ab5d03f1284b67883e8d87530", "cifar-10-batches-bin"),
    "cifar100": ("cifar-100-binary.tar.gz", "03b5dce01913d631647c71ecec9e9cb8", "cifar-100-binary"),
}


def read_label_names(path: Path) -> list[str]:
    """One class name a line; blank lines (the official files end with some) are dropped."""
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text file of class names ({e})") from e
    return [line.strip() for line in text.splitlines() if line.strip()]


def read_cifar_records(path: Path, label_bytes: int, label_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images uint8 (N, 3, 32, 32) and labels int64 (N,) from one CIFAR binary file; `label_index` picks
    which of the `label_bytes` leading bytes is the label."""
    raw = np.fromfile(path, dtype=np.uint8)
    record = label_bytes + CIFAR_PIXELS
    if raw.size == 0 or raw.size % record:
        raise ValueError(f"{path}: {raw.size} bytes is not a whole number of {record}-byte CIFAR records")
    rows = raw.reshape(-1, record)
    labels = torch.from_numpy(rows[:, label_index].astype(np.int64))
    images = torch.from_numpy(np.ascontiguousarray(rows[:, label_bytes:]).reshape(-1, 3, 32, 32))
    return images, labels


def _find_cifar_folder(needed: Sequence[str], subfolders: Sequence[str], data_dir) -> Path | None:
    for folder in candidate_folders(data_roots(data_dir), subfolders):
        if all((folder / name).is_file() for name in needed):
            return folder
    return None


def download_cifar(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    base_url: str | None = None,
    md5: str | None = None,
    progress: bool = True,
) -> Path:
    """Download CIFAR-10 or CIFAR-100's binary archive into the download root, check its MD5, unpack it there
    (through a temporary folder, renamed into place when complete; tar members outside it refused) and
    return the unpacked folder. `base_url` defaults to `$VITKIT_CIFAR_URL`, else the official location."""
    archive, published_md5, folder_name = CIFAR_ARCHIVES[name]
    base_url = base_url or os.environ.get(CIFAR_URL_ENV) or CIFAR_URL
    root = download_root(data_dir)
    dest = root / folder_name
    if dest.exists():
        raise DownloadError(f"{dest} exists but lacks some of {name}'s files: remove it and try again")
    tgz = download_file(base_url.rstrip("/") + "/" + archive, root / archive, md5=md5 or published_md5,
                        progress=progress)
    try:
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{folder_name}.") as tmp:
            try:
                with tarfile.open(tgz) as tar:
                    tar.extractall(tmp, filter="data")
            except (tarfile.TarError, OSError, EOFError, zlib.error) as e:  # zlib: a corrupt deflate stream
                raise DownloadError(f"{tgz}: cannot unpack ({e})") from e
            if not (Path(tmp) / folder_name).is_dir():
                raise DownloadError(f"{tgz}: has no {folder_name}/ folder")
            os.replace(Path(tmp) / folder_name, dest)
    finally:
        tgz.unlink(missing_ok=True)
    return dest


def load_cifar(
    name: str,
    split: str = "train",
    data_dir: str | os.PathLike[str] | None = None,
    label: str = "fine",
    download: bool = False,
    base_url: str | None = None,
    md5: str | None = None,
) -> TensorImageDataset:
    """CIFAR-10 (`name="cifar10"`) or CIFAR-100 (`"cifar100"`, with its `"fine"` 100 or `"coarse"` 20
    labels) from the binary files; 32x32 colour images. With `download`, the official archive is fetched
    when the files are nowhere on disk (see download_cifar)."""
    split = check_split(split, name)
    if name == "cifar10":
        files, meta, subfolders, label_bytes, label_index = (
            CIFAR10_FILES[split], CIFAR10_META, CIFAR10_SUBFOLDERS, 1, 0)
    elif name == "cifar100":
        if label not in CIFAR100_META:
            raise ValueError(f"cifar100 label={label!r}: choose fine or coarse")
        files, meta, subfolders, label_bytes = (CIFAR100_FILES[split], CIFAR100_META[label],
                                                CIFAR100_SUBFOLDERS, 2)
        label_index = 1 if label == "fine" else 0  # each record starts with the coarse byte, then the fine
    else:
        raise ValueError(f"unknown CIFAR {name!r}: choose cifar10 or cifar100")
    places = ", ".join(str(p) for p in data_roots(data_dir))
    missing = (f"{name} ({split}): no folder with {', '.join([*files, meta])} in {places} "
               f"(nor their {', '.join(subfolders)} sub-folders)")
    folder = found_or_downloaded(
        _find_cifar_folder([*files, meta], subfolders, data_dir), missing, download,
        lambda: download_cifar(name, data_dir, base_url=base_url, md5=md5),
        "get the binary version from https://www.cs.toronto.edu/~kriz/cifar.html and unpack it there")
    warn_if_passed_over(data_dir, subfolders, [(f,) for f in [*files, meta]], folder, f"{name} ({split})")
    classes = read_label_names(folder / meta)
    parts = [read_cifar_records(folder / f, label_bytes, label_index) for f in files]
    images = torch.cat([p[0] for p in parts])
    targets = torch.cat([p[1] for p in parts])
    if targets.numel() and int(targets.max()) >= len(classes):
        raise ValueError(f"{folder}: label {int(targets.max())} but {folder / meta} names {len(classes)} "
                         "classes")
    return TensorImageDataset(images, targets, classes, name=f"{name}/{split}")
