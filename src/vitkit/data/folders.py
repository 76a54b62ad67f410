"""Image folders: one sub-folder per class, each image opened with `vitkit.data.images.open_image`, bad files
skipped on request."""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import Dataset

from .images import IMAGE_EXTENSIONS, BadImageError, image_files, is_ignored_name, open_image

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
                     f"class folder{'s' if len(empty) > 1 else ''} {short_list([n + '/' for n in empty])}")
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


def short_list(names: Sequence[str], most: int = 10) -> str:
    """A list of class names for a one-line message: the first `most`, then how many in all."""
    shown = ", ".join(map(str, names[:most]))
    return shown if len(names) <= most else f"{shown}, ... ({len(names)} in all)"
