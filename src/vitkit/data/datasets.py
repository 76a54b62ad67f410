"""`resolve`, which turns a dataset's name or a folder into the dataset vitkit trains and evaluates on.

* `fashion-mnist` (vitkit.data.fashion_mnist), `cifar10` and `cifar100` (vitkit.data.cifar) are held in memory
  as whole uint8 tensors (vitkit.data.tensor_dataset: `.images`, (N, C, H, W); `.targets`, int64 (N,)); their
  items are `(uint8 tensor (C, H, W), int label)`. Where they are looked for: vitkit.data.locations.
* A folder of class sub-folders (vitkit.data.folders): items are `(PIL image, int label)`.
* `hf:FOLDER`, or a folder that `datasets.save_to_disk` wrote (vitkit.data.hf_folder): the same items.
* `shards:PATTERN`, WebDataset-style tar shards (vitkit.data.shards): a `ShardSet`, for training only, which
  vitkit.train.shard_batches streams.

torchvision.transforms.v2 accepts both. Every dataset has `.classes` (list of names) and `.num_channels` (1
for grey, 3 for colour).
"""

from __future__ import annotations

import os
from pathlib import Path

from torch.utils.data import Dataset

from .cifar import load_cifar
from .fashion_mnist import load_fashion_mnist
from .folders import ImageFolderDataset
from .hf_folder import HF_PREFIX, hf_split_names, is_hf_folder, load_hf_folder
from .locations import check_split
from .shards import SHARDS_PREFIX, ShardSet, open_shards

DATASET_NAMES = ("fashion-mnist", "cifar10", "cifar100")
_ALIASES = {"fashion-mnist": "fashion-mnist", "fashionmnist": "fashion-mnist", "fmnist": "fashion-mnist",
            "cifar10": "cifar10", "cifar-10": "cifar10", "cifar100": "cifar100", "cifar-100": "cifar100"}
_SPLIT_FOLDERS = {"train": ("train", "training"), "test": ("test", "testing"),
                  "val": ("val", "valid", "validation")}


def _split_folder(root: Path, split: str) -> Path:
    """A folder's split: its `train`/`test`/`val` sub-folder when it has split sub-folders, else itself."""
    if split not in _SPLIT_FOLDERS:
        raise ValueError(f"unknown split {split!r}: choose from {', '.join(_SPLIT_FOLDERS)}")
    for name in _SPLIT_FOLDERS[split]:
        if (root / name).is_dir():
            return root / name
    present = [n for names in _SPLIT_FOLDERS.values() for n in names if (root / n).is_dir()]
    if present:
        raise FileNotFoundError(f"{root} has split folders {', '.join(present)} but no {split!r} one")
    return root


def own_splits(data: str | os.PathLike[str]) -> tuple[str, ...]:
    """The splits, of train, val and test, that `data` has of its own (without reading an image): the named
    datasets have train and test; a folder the split sub-folders it has (train alone where its class folders
    lie in it directly); a Hugging Face dataset folder its DatasetDict's splits (train alone for a single
    dataset); shards train alone."""
    text = str(data).strip()
    if text.startswith(SHARDS_PREFIX):
        return ("train",)
    key = text.lower().replace("_", "-")
    path = Path(text.removeprefix(HF_PREFIX)).expanduser()
    if key in _ALIASES and not path.is_dir():
        return ("train", "test")
    if text.startswith(HF_PREFIX) or is_hf_folder(path):
        names = hf_split_names(path)
        return tuple(s for s, aliases in _SPLIT_FOLDERS.items() if any(a in names for a in aliases)) \
            if names else ("train",)
    if path.is_dir():
        found = tuple(s for s, aliases in _SPLIT_FOLDERS.items() if any((path / a).is_dir() for a in aliases))
        return found or ("train",)
    raise FileNotFoundError(f"{data}: not a folder, and not a dataset name ({', '.join(DATASET_NAMES)}), "
                            "hf:FOLDER or shards:PATTERN")


def evaluation_split(data: str | os.PathLike[str], split: str) -> str:
    """`split` itself, or for 'auto' the split that evaluating `data` means: its test split where it has one,
    else its val split, else its training images (a folder of class folders)."""
    if split != "auto":
        return split
    own = own_splits(data)
    return next(s for s in ("test", "val", "train") if s in own)


def split_name(data: str | os.PathLike[str] | Dataset, split: str) -> str:
    """The split `resolve(data, split)` reads: the named datasets have no validation split and read their test
    split for val; a folder reads the split it is asked for."""
    key = str(data).strip().lower().replace("_", "-")
    if not isinstance(data, Dataset) and key in _ALIASES and not Path(str(data)).is_dir():
        return check_split(split, _ALIASES[key])
    return split


def resolve(
    data: str | os.PathLike[str] | Dataset,
    split: str = "train",
    data_dir: str | os.PathLike[str] | None = None,
    download: bool = True,
    skip_bad_images: bool = False,
) -> Dataset | ShardSet:
    """The dataset `data` names: `fashion-mnist`, `cifar10`, `cifar100`, or a folder of class sub-folders
    (with `train`/`test`/`val` split sub-folders used when present; an existing folder wins over a dataset
    name it happens to share), a Hugging Face dataset folder (`hf:FOLDER`, or any folder save_to_disk wrote),
    or tar shards (`shards:PATTERN`, the training split only). A Dataset is returned unchanged.

    `split` is train, test or val (val means test for the named datasets, which have no validation split).
    `download` lets a named dataset be fetched from its official location when it is nowhere on disk (with
    its published MD5 checked); `skip_bad_images` applies to folders. A named dataset's files are taken from
    the first place that has all of them (see data_roots); when `data_dir` is given but lacks some, a warning
    names them and the place used instead.

    A folder's dataset tells the split asked for (`.split`) and whether the folder had no split sub-folders,
    so that its whole self served it (`.split_of_root`): a test or val split with `split_of_root` holds the
    training images.
    """
    if isinstance(data, Dataset):
        return data
    text = str(data).strip()
    if text.startswith(SHARDS_PREFIX):
        if split != "train":
            raise ValueError(f"{text}: shards are read for training only, not as a {split!r} split; set "
                             "data.val_split='' (or evaluate on a folder with `vitkit eval RUN/best --data "
                             "FOLDER`)")
        return open_shards(text[len(SHARDS_PREFIX):])
    if text.startswith(HF_PREFIX) or is_hf_folder(Path(text).expanduser()):
        return load_hf_folder(text, split)
    key = str(data).strip().lower().replace("_", "-")
    if key in _ALIASES and not Path(str(data)).is_dir():
        name = _ALIASES[key]
        if name == "fashion-mnist":
            return load_fashion_mnist(split, data_dir, download=download)
        return load_cifar(name, split, data_dir, download=download)
    path = Path(data).expanduser()
    if path.is_dir():
        folder = _split_folder(path, split)
        dataset = ImageFolderDataset(folder, skip_bad_images=skip_bad_images)
        dataset.split, dataset.split_of_root = split, folder == path
        return dataset
    raise FileNotFoundError(f"{data}: not a folder, and not a dataset name ({', '.join(DATASET_NAMES)}), "
                            "hf:FOLDER or shards:PATTERN")
