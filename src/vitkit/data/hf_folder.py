"""A Hugging Face dataset saved on disk (`datasets.Dataset.save_to_disk`, or a DatasetDict's), as a map-style
dataset vitkit trains and evaluates on: `hf:/path` names one, and a folder holding `dataset_info.json` and
`state.json` (or `dataset_dict.json`) is taken for one.

The image column is the first of the `Image` feature, the label column the first `ClassLabel`, whose names are
the classes. Items are (PIL image, int label); the image is decoded on access, so in the DataLoader workers.
The Arrow files are memory-mapped, so the workers share them without copying.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from PIL import Image
from torch.utils.data import Dataset

HF_PREFIX = "hf:"
_SPLITS = {"train": ("train",), "test": ("test",), "val": ("validation", "val", "valid")}


def is_hf_folder(path: Path) -> bool:
    """Whether `path` is a folder that `datasets.load_from_disk` reads."""
    return path.is_dir() and ((path / "dataset_info.json").is_file() and (path / "state.json").is_file()
                              or (path / "dataset_dict.json").is_file())


def hf_split_names(path: Path) -> tuple[str, ...]:
    """The split names of the DatasetDict saved in `path` (its dataset_dict.json); () for a single dataset."""
    index = Path(path) / "dataset_dict.json"
    if not index.is_file():
        return ()
    try:
        return tuple(json.loads(index.read_text()).get("splits", ()))
    except (OSError, ValueError) as e:
        raise ValueError(f"{index}: unreadable ({e})") from None


class HFImageDataset(Dataset):
    """The (image, label) items of a `datasets.Dataset`. `split_of_root` is True when the folder holds one
    dataset, not a DatasetDict of splits, so that it served whatever split was asked (as image folders do)."""

    def __init__(self, dataset, where: str, split: str | None = None, split_of_root: bool = False):
        from datasets import ClassLabel
        from datasets import Image as ImageFeature

        features = dataset.features
        self.image_column = next((k for k, f in features.items() if isinstance(f, ImageFeature)), None)
        self.label_column = next((k for k, f in features.items() if isinstance(f, ClassLabel)), None)
        if self.image_column is None or self.label_column is None:
            found = ", ".join(f"{k} ({type(f).__name__})" for k, f in features.items())
            raise ValueError(f"{where}: a dataset to train on needs an Image column and a ClassLabel column; "
                             f"its features are {found} (cast them with dataset.cast_column)")
        self.dataset, self.where = dataset, where
        self.classes = list(features[self.label_column].names)
        self.split, self.split_of_root = split, split_of_root
        grey = len(dataset) and dataset[0][self.image_column].mode in ("L", "1", "I;16")
        self.mode = "L" if grey else "RGB"

    @property
    def num_channels(self) -> int:
        return 1 if self.mode == "L" else 3

    @property
    def targets(self):
        import torch

        return torch.tensor(self.dataset[self.label_column], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        row = self.dataset[int(index)]
        return row[self.image_column].convert(self.mode), int(row[self.label_column])

    def __repr__(self) -> str:
        return f"HFImageDataset({self.where!r}, {len(self)} images, {len(self.classes)} classes)"


def load_hf_folder(path: str | os.PathLike[str], split: str = "train") -> HFImageDataset:
    """The split `split` (train, test or val) of the dataset saved in `path`: a DatasetDict's split of that
    name (val: validation, val or valid), or the one dataset the folder holds."""
    from .shards import require_data_extra

    require_data_extra("datasets")
    from datasets import DatasetDict, load_from_disk

    path = Path(str(path).removeprefix(HF_PREFIX)).expanduser()
    if not is_hf_folder(path):
        raise FileNotFoundError(f"{path}: not a dataset saved by datasets' save_to_disk (no "
                                "dataset_info.json and state.json, nor dataset_dict.json)")
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}: choose from {', '.join(_SPLITS)}")
    loaded = load_from_disk(str(path))
    if isinstance(loaded, DatasetDict):
        name = next((n for n in _SPLITS[split] if n in loaded), None)
        if name is None:
            raise FileNotFoundError(f"{path} has splits {', '.join(loaded)} but no {split!r} one")
        return HFImageDataset(loaded[name], f"{path} ({name})", split)
    return HFImageDataset(loaded, str(path), split, split_of_root=True)
