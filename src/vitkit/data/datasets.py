"""The datasets vitkit trains and evaluates on, and `resolve`, which turns a name or a folder into one.

* Fashion-MNIST from its IDX files (gzip-compressed or not), downloaded from the official location and checked
  against the published MD5s when it is nowhere on disk.
* CIFAR-10 and CIFAR-100 in their binary format (never the pickled Python one), downloaded likewise.
* Image folders: one sub-folder per class, each image opened with `vitkit.data.images.open_image`.

Fashion-MNIST and CIFAR are held in memory as whole uint8 tensors (`.images`, (N, C, H, W); `.targets`, int64
(N,)), and their items are `(uint8 tensor (C, H, W), int label)`; an image folder's items are
`(PIL image, int label)`. torchvision.transforms.v2 accepts both. Every dataset has `.classes` (list of names)
and `.num_channels` (1 for grey, 3 for colour).

Where a dataset is looked for, in order: the `data_dir` argument, `$VITKIT_DATA`, `~/.cache/vitkit`, and
`/usr/share/datasets` (Debian's dataset-fashion-mnist installs `/usr/share/datasets/fashion-mnist`). In each
place the files may lie directly or in the dataset's own sub-folder (`fashion-mnist/`, `cifar-10-batches-bin/`,
`cifar-100-binary/`, ...).
"""

from __future__ import annotations

import copy
import gzip
import os
import tarfile
import tempfile
import warnings
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Subset

from .download import DownloadError, download_file
from .images import IMAGE_EXTENSIONS, BadImageError, image_files, is_ignored_name, open_image

# --- where datasets are looked for ------------------------------------------------------------------------
DATA_ENV = "VITKIT_DATA"
SYSTEM_DATA_DIRS: tuple[Path, ...] = (Path("/usr/share/datasets"),)  # Debian's dataset-* packages
SPLITS = ("train", "test")


def cache_dir() -> Path:
    """vitkit's own data cache, `~/.cache/vitkit`."""
    return Path.home() / ".cache" / "vitkit"


def data_roots(data_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The places a dataset is looked for, in order: `data_dir`, `$VITKIT_DATA`, `~/.cache/vitkit`, then the
    system's dataset folders."""
    roots = []
    if data_dir is not None:
        roots.append(Path(data_dir).expanduser())
    if os.environ.get(DATA_ENV):
        roots.append(Path(os.environ[DATA_ENV]).expanduser())
    roots.append(cache_dir())
    roots.extend(SYSTEM_DATA_DIRS)
    return roots


def download_root(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where a download goes: `data_dir`, else `$VITKIT_DATA`, else `~/.cache/vitkit`."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV]).expanduser()
    return cache_dir()


def _candidate_folders(roots: Sequence[Path], subfolders: Sequence[str]) -> list[Path]:
    """Each root itself, then each of the dataset's usual sub-folders of it."""
    out = []
    for root in roots:
        out.append(root)
        out.extend(root / sub for sub in subfolders)
    return out


def _warn_if_passed_over(data_dir, subfolders: Sequence[str], needed: Sequence[Sequence[str]], used: Path,
                         what: str) -> None:
    """Warn when the files were taken from `used` although `data_dir` was given: which of them `data_dir` (or
    the one of its dataset sub-folders that has the most of them) lacks. `needed` holds, for each file, the
    names it may have (e.g. with and without .gz)."""
    if data_dir is None:
        return
    given = _candidate_folders([Path(data_dir).expanduser()], subfolders)
    if used in given:
        return
    have = [[any((folder / name).is_file() for name in names) for names in needed] for folder in given]
    best = max(range(len(given)), key=lambda i: sum(have[i]))  # the first of the fullest
    missing = [" or ".join(names) for names, ok in zip(needed, have[best], strict=True) if not ok]
    if any(have[best]):
        lacks = f"{given[best]} lacks {', '.join(missing)}"
    elif not given[0].is_dir():
        lacks = f"data_dir {given[0]} does not exist"
    else:
        lacks = (f"{given[0]} (nor its {', '.join(subfolders)} sub-folders) has none of its files "
                 f"({', '.join(missing)})")
    warnings.warn(f"{what}: {lacks}; using {used} instead", UserWarning, stacklevel=3)


def _check_split(split: str, name: str) -> str:
    # The named datasets have no validation split; their test split serves for evaluation.
    split = {"val": "test", "valid": "test", "validation": "test"}.get(split, split)
    if split not in SPLITS:
        raise ValueError(f"{name} has no split {split!r}; choose from train, test (val means test)")
    return split


# --- in-memory datasets -----------------------------------------------------------------------------------
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


# --- Fashion-MNIST ----------------------------------------------------------------------------------------
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
        raise ValueError(f"{path}: header says shape {shape} ({expected} bytes), file has {len(raw) - header}")
    data = np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)
    return torch.from_numpy(data.copy())


def _find_file(folder: Path, base: str) -> Path | None:
    for name in (base + ".gz", base):
        if (folder / name).is_file():
            return folder / name
    return None


def find_fashion_mnist(split: str = "train", data_dir: str | os.PathLike[str] | None = None) -> tuple[Path, Path] | None:
    """The (images, labels) IDX files of a split, from the first place that has both; None if none has."""
    split = _check_split(split, "fashion-mnist")
    images_base, labels_base = FASHION_MNIST_FILES[split]
    for folder in _candidate_folders(data_roots(data_dir), FASHION_MNIST_SUBFOLDERS):
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
    split = _check_split(split, "fashion-mnist")
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
    split = _check_split(split, "fashion-mnist")
    found = find_fashion_mnist(split, data_dir)
    if found is None:
        places = ", ".join(str(p) for p in data_roots(data_dir))
        missing = f"Fashion-MNIST ({split}) not found in {places} (nor their fashion-mnist/ sub-folders)"
        if not download:
            raise FileNotFoundError(f"{missing}; allow the download, or install Debian's dataset-fashion-mnist")
        try:
            found = download_fashion_mnist(split, data_dir, base_url=base_url, md5s=md5s)
        except DownloadError as e:
            raise DownloadError(f"{missing}, and {e}") from e
    images_path, labels_path = found
    _warn_if_passed_over(data_dir, FASHION_MNIST_SUBFOLDERS,
                         [(base + ".gz", base) for base in FASHION_MNIST_FILES[split]], images_path.parent,
                         f"Fashion-MNIST ({split})")
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3:
        raise ValueError(f"{images_path}: expected images (N, H, W), got shape {tuple(images.shape)}")
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise ValueError(f"{labels_path}: {tuple(labels.shape)} labels for {images.shape[0]} images in {images_path}")
    if labels.numel() and int(labels.max()) >= len(FASHION_MNIST_CLASSES):
        raise ValueError(f"{labels_path}: label {int(labels.max())} out of range 0-9")
    return TensorImageDataset(images.unsqueeze(1), labels, FASHION_MNIST_CLASSES, name=f"fashion-mnist/{split}")


# --- CIFAR-10 and CIFAR-100, binary version ---------------------------------------------------------------
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
    for folder in _candidate_folders(data_roots(data_dir), subfolders):
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
    split = _check_split(split, name)
    if name == "cifar10":
        files, meta, subfolders, label_bytes, label_index = (
            CIFAR10_FILES[split], CIFAR10_META, CIFAR10_SUBFOLDERS, 1, 0)
    elif name == "cifar100":
        if label not in CIFAR100_META:
            raise ValueError(f"cifar100 label={label!r}: choose fine or coarse")
        files, meta, subfolders, label_bytes = CIFAR100_FILES[split], CIFAR100_META[label], CIFAR100_SUBFOLDERS, 2
        label_index = 1 if label == "fine" else 0  # each record starts with the coarse byte, then the fine
    else:
        raise ValueError(f"unknown CIFAR {name!r}: choose cifar10 or cifar100")
    folder = _find_cifar_folder([*files, meta], subfolders, data_dir)
    if folder is None:
        places = ", ".join(str(p) for p in data_roots(data_dir))
        missing = (f"{name} ({split}): no folder with {', '.join([*files, meta])} in {places} "
                   f"(nor their {', '.join(subfolders)} sub-folders)")
        if not download:
            raise FileNotFoundError(f"{missing}; allow the download, or get the binary version from "
                                    "https://www.cs.toronto.edu/~kriz/cifar.html and unpack it there")
        try:
            folder = download_cifar(name, data_dir, base_url=base_url, md5=md5)
        except DownloadError as e:
            raise DownloadError(f"{missing}, and {e}") from e
    _warn_if_passed_over(data_dir, subfolders, [(f,) for f in [*files, meta]], folder, f"{name} ({split})")
    classes = read_label_names(folder / meta)
    parts = [read_cifar_records(folder / f, label_bytes, label_index) for f in files]
    images = torch.cat([p[0] for p in parts])
    targets = torch.cat([p[1] for p in parts])
    if targets.numel() and int(targets.max()) >= len(classes):
        raise ValueError(f"{folder}: label {int(targets.max())} but {folder / meta} names {len(classes)} classes")
    return TensorImageDataset(images, targets, classes, name=f"{name}/{split}")


# --- image folders ----------------------------------------------------------------------------------------
# Errors opening a listed file that make it unreadable, as a corrupt one (BadImageError) is: gone since it was
# listed, no permission, a folder by an image's name. Others (too many open files, ...) are not the file's fault.
_UNREADABLE = (BadImageError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


class ImageFolderDataset(Dataset):
    """An image folder: one sub-folder per class (sorted names; class index = position), image files found
    by extension, recursively (`vitkit.data.images.image_files`: hidden files and folders and `__MACOSX`
    ignored, symbolic links to folders followed). Items are `(PIL image in `mode`, int label)`. A class folder
    without any image file is refused (ValueError naming it), as torchvision's ImageFolder does.

    Bad files (corrupt, truncated, empty, not an image, decompression bombs, broken symbolic links, unreadable)
    are found lazily, when an item is loaded. Without `skip_bad_images` loading one raises `BadImageError` (or
    the OSError) naming the file. With it, the file is recorded as skipped and the next good file in order is
    returned in its place (what training wants: every batch full); `read(index)` returns None instead (what
    evaluation wants: each readable image scored once). The record lives in shared memory, so skips found in
    DataLoader worker processes count too: `num_skipped` and `skipped` (the paths) give the distinct bad files
    found so far, and a skipped file is not opened again. `check_all()` finds them all up front.

    `split` and `split_of_root` tell how `resolve` chose the folder: `split` is the split asked for (None when
    built directly) and `split_of_root` is True when the folder given to `resolve` has no split sub-folders
    (train/, test/, val/, ...), so its whole self served that split. Two such datasets of one folder hold the
    same images: a test or val split with `split_of_root` is the training images. In general two datasets read
    the same images when `a.root.resolve() == b.root.resolve()`.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        mode: str = "RGB",
        skip_bad_images: bool = False,
        extensions: Sequence[str] = IMAGE_EXTENSIONS,
    ):
        self.root = Path(root)
        if not self.root.is_dir():
            raise NotADirectoryError(f"{self.root}: not a folder")
        self.mode = mode
        self.skip_bad_images = skip_bad_images
        self.extensions = exts = tuple(e.lower() for e in extensions)
        self.split: str | None = None
        self.split_of_root = False
        self.classes = sorted(d.name for d in self.root.iterdir() if d.is_dir() and not is_ignored_name(d.name))
        if not self.classes:
            raise ValueError(f"{self.root}: no class sub-folders (expected one folder of images per class)")
        self.samples: list[tuple[Path, int]] = []
        empty = []
        for index, name in enumerate(self.classes):
            files = image_files(self.root / name, exts)
            if not files:
                empty.append(name)
            self.samples += [(f, index) for f in files]
        if empty:
            which = ("any of its class folders" if len(empty) == len(self.classes) else
                     f"class folder{'s' if len(empty) > 1 else ''} {_names([n + '/' for n in empty])}")
            raise ValueError(f"{self.root}: no image files ({', '.join(exts)}) in {which}; every class needs "
                             "images (remove a folder that is not a class, or fill it)")
        self.targets = torch.tensor([t for _, t in self.samples], dtype=torch.int64)
        # One flag per file, in shared memory so that DataLoader workers' findings are seen here.
        self._bad = torch.zeros(len(self.samples), dtype=torch.bool).share_memory_()

    @property
    def num_channels(self) -> int:
        return 1 if self.mode == "L" else 3

    @property
    def skipped(self) -> list[Path]:
        """The bad files found so far (only with skip_bad_images)."""
        return [self.samples[i][0] for i in torch.nonzero(self._bad).flatten().tolist()]

    @property
    def num_skipped(self) -> int:
        return int(self._bad.sum())

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        n = len(self.samples)
        for step in range(n):
            item = self.read((index + step) % n)
            if item is not None:
                return item
        raise BadImageError(f"{self.root}: every one of its {n} image files is unreadable")

    def read(self, index: int) -> tuple[Image.Image, int] | None:
        """Item `index` itself, or None when its file is bad and skipped; never another item in its place."""
        if self._bad[index]:
            return None
        path, target = self.samples[index]
        try:
            return open_image(path, self.mode), target
        except _UNREADABLE:
            if not self.skip_bad_images:
                raise
            self._bad[index] = True
            return None

    def relabeled(self, mapping: Sequence[int], classes: Sequence[str]) -> ImageFolderDataset:
        """The same files with label `t` as `mapping[t]`, an index into `classes` (see with_classes), e.g. a
        validation folder numbered as its training folder. Shares the record of bad files."""
        out = copy.copy(self)
        out.classes = list(classes)
        out.samples = [(path, mapping[t]) for path, t in self.samples]
        out.targets = torch.tensor([t for _, t in out.samples], dtype=torch.int64)
        return out

    def check_all(self, progress: bool = True) -> list[Path]:
        """Open every file now; with skip_bad_images the bad ones are recorded (and returned), without it the
        first bad one raises BadImageError."""
        from tqdm import tqdm

        for i, (path, _) in enumerate(tqdm(self.samples, desc=f"checking {self.root.name}", disable=not progress,
                                           leave=False)):
            if self._bad[i]:
                continue
            try:
                open_image(path, self.mode)
            except _UNREADABLE:
                if not self.skip_bad_images:
                    raise
                self._bad[i] = True
        return self.skipped

    def __repr__(self) -> str:
        return f"ImageFolderDataset({str(self.root)!r}, {len(self)} images, {len(self.classes)} classes)"


class DatasetView(Dataset):
    """The items of `dataset`, each passed through `map_item(image, label)`; keeps the wrapped dataset's
    length and `num_channels`, and its `classes` unless others are given."""

    def __init__(self, dataset: Dataset, classes: Sequence[str] | None = None):
        self.dataset = dataset
        self.classes = list(classes if classes is not None else getattr(dataset, "classes", []))

    @property
    def num_channels(self) -> int:
        return self.dataset.num_channels

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.map_item(*self.dataset[index])

    def map_item(self, image, label):
        """The item as the view shows it: here unchanged; subclasses transform the image or the label."""
        return image, label

    def read(self, index: int):
        """Item `index` as the view shows it, or None when it is a bad image file that is skipped (read_item)."""
        item = read_item(self.dataset, index)
        return None if item is None else self.map_item(*item)


class TransformedDataset(DatasetView):
    """A dataset whose images go through `transform` (e.g. build_train_transform's), labels unchanged."""

    def __init__(self, dataset: Dataset, transform: Callable):
        super().__init__(dataset)
        self.transform = transform

    def map_item(self, image, label):
        return self.transform(image), label


def read_item(dataset: Dataset, index: int):
    """Item `index` of `dataset` itself, or None when it is a bad image file that is skipped: unlike
    `dataset[index]`, never another item in its place (through Subsets and DatasetViews)."""
    while isinstance(dataset, Subset):
        dataset, index = dataset.dataset, dataset.indices[index]
    read = getattr(dataset, "read", None)
    return read(index) if read is not None else dataset[index]


class LabelMapped(DatasetView):
    """A dataset whose label `t` becomes `mapping[t]`, with `classes` as its class names (see with_classes)."""

    def __init__(self, dataset: Dataset, mapping: Sequence[int], classes: Sequence[str]):
        super().__init__(dataset, classes)
        self.mapping = list(mapping)

    def map_item(self, image, label):
        return image, self.mapping[label]


def _names(names: Sequence[str], most: int = 10) -> str:
    """A list of class names for a one-line message: the first `most`, then how many in all."""
    shown = ", ".join(map(str, names[:most]))
    return shown if len(names) <= most else f"{shown}, ... ({len(names)} in all)"


def with_classes(dataset: Dataset, classes: Sequence[str], what: str = "the dataset",
                 reference: str = "the training data") -> Dataset:
    """`dataset` with its labels indexing `classes`, matched by name. A folder's class index is the position
    of its sub-folder among its own, so a validation folder lacking one of the training classes would shift the
    labels of every class after it; matching by name keeps them. A class of `dataset` that `classes` lacks
    raises ValueError naming it (`what` has classes `reference` lacks). Unchanged when the lists are equal or
    `dataset` has no `.classes`."""
    own, classes = list(getattr(dataset, "classes", None) or []), list(classes)
    if not own or own == classes:
        return dataset
    known = set(classes)
    unknown = [name for name in own if name not in known]
    if unknown:
        raise ValueError(f"{what} has classes that {reference} lacks: {_names(unknown)} (classes are matched by "
                         f"name; {reference} has {_names(classes)})")
    index = {name: i for i, name in enumerate(classes)}
    mapping = [index[name] for name in own]
    if isinstance(dataset, ImageFolderDataset):
        return dataset.relabeled(mapping, classes)
    if isinstance(dataset, TensorImageDataset):
        return TensorImageDataset(dataset.images, torch.tensor(mapping)[dataset.targets], classes, dataset.name)
    return LabelMapped(dataset, mapping, classes)


# --- names and folders to datasets ------------------------------------------------------------------------
DATASET_NAMES = ("fashion-mnist", "cifar10", "cifar100")
_ALIASES = {"fashion-mnist": "fashion-mnist", "fashionmnist": "fashion-mnist", "fmnist": "fashion-mnist",
            "cifar10": "cifar10", "cifar-10": "cifar10", "cifar100": "cifar100", "cifar-100": "cifar100"}
_SPLIT_FOLDERS = {"train": ("train", "training"), "test": ("test", "testing"), "val": ("val", "valid", "validation")}


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


def split_name(data: str | os.PathLike[str] | Dataset, split: str) -> str:
    """The split `resolve(data, split)` reads: the named datasets have no validation split and read their test
    split for val; a folder reads the split it is asked for."""
    key = str(data).strip().lower().replace("_", "-")
    if not isinstance(data, Dataset) and key in _ALIASES and not Path(str(data)).is_dir():
        return _check_split(split, _ALIASES[key])
    return split


def resolve(
    data: str | os.PathLike[str] | Dataset,
    split: str = "train",
    data_dir: str | os.PathLike[str] | None = None,
    download: bool = True,
    skip_bad_images: bool = False,
) -> Dataset:
    """The dataset `data` names: `fashion-mnist`, `cifar10`, `cifar100`, or a folder of class sub-folders
    (with `train`/`test`/`val` split sub-folders used when present; an existing folder wins over a dataset
    name it happens to share). A Dataset is returned unchanged.

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
    raise FileNotFoundError(f"{data}: not a folder, and not a dataset name ({', '.join(DATASET_NAMES)})")
