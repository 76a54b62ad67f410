"""Views of a dataset: its images transformed (TransformedDataset) or its labels renumbered (LabelMapped,
with_classes), and `read_item`, which reads one item without putting another in place of a bad image file."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.data import Dataset, Subset

from .folders import ImageFolderDataset, short_list
from .tensor_dataset import TensorImageDataset


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
        raise ValueError(f"{what} has classes that {reference} lacks: {short_list(unknown)} (classes are matched by "
                         f"name; {reference} has {short_list(classes)})")
    index = {name: i for i, name in enumerate(classes)}
    mapping = [index[name] for name in own]
    if isinstance(dataset, ImageFolderDataset):
        return dataset.relabeled(mapping, classes)
    if isinstance(dataset, TensorImageDataset):
        return TensorImageDataset(dataset.images, torch.tensor(mapping)[dataset.targets], classes, dataset.name)
    return LabelMapped(dataset, mapping, classes)
