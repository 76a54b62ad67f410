"""Parts of a dataset. The smaller datasets quick runs ask for (`data.limit`, `data.val_limit`, eval's
`--limit`, fewshot's and probe's `--max-train`/`--max-test`): N items spread evenly over the dataset, every
(len / N)-th, rather than the first N. An image folder lists its files class by class, so its first N would
hold only the first classes; spread out, every class keeps its share. Deterministic, with no random draw.
The part of a training split held out for validation (`holdout_split`), each class in its share. And the
class-balanced subsets of data-scaling studies (`balanced_indices`)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, Subset

from .shards import ShardSet
from .tensor_dataset import TensorImageDataset


def spread_indices(length: int, n: int) -> list[int]:
    """`n` indices of `range(length)` spread evenly, in order: floor(i * length / n) for i < n."""
    return [i * length // n for i in range(n)]


def spread_subset(dataset: Dataset, n: int | None) -> Dataset:
    """`n` items of `dataset` spread evenly over it (all of it when n is 0, None or at least its length),
    keeping its `.classes`, its `.targets` and the in-memory fast path."""
    if not n or n >= len(dataset):
        return dataset
    if isinstance(dataset, ShardSet):
        raise ValueError(f"shards:{dataset.pattern}: a limit of {n} images does not apply to shards, which "
                         "are read whole; name fewer shards in the pattern instead")
    return take(dataset, spread_indices(len(dataset), n))


def take(dataset: Dataset, index: list[int]) -> Dataset:
    """The items `index` of `dataset`, keeping its `.classes`, its `.targets` and the in-memory fast path (a
    TensorImageDataset stays one)."""
    classes = list(getattr(dataset, "classes", None) or [])
    if isinstance(dataset, TensorImageDataset):
        rows = torch.tensor(index, dtype=torch.int64)
        return TensorImageDataset(dataset.images[rows], dataset.targets[rows], classes, dataset.name)
    subset = Subset(dataset, index)
    subset.classes = classes
    targets = getattr(dataset, "targets", None)
    if targets is not None:
        subset.targets = torch.as_tensor(targets)[torch.tensor(index, dtype=torch.int64)]
    if hasattr(dataset, "num_channels"):  # a folder's, which views of it report
        subset.num_channels = dataset.num_channels
    return subset


# The held-out part is drawn with this seed whatever the run's: every seed of a recipe validates on the same
# images, and trains on the same others.
HOLDOUT_SEED = 0


def holdout_indices(labels: torch.Tensor, n: int, seed: int = HOLDOUT_SEED) -> list[int]:
    """`n` indices of a split whose items have `labels`, each class in its share of the split (n x its count
    / the split's size, the remainders to the largest fractions), drawn at random within the class (torch
    generator `seed`), in order. ValueError when n leaves no item to train on."""
    labels = torch.as_tensor(labels, dtype=torch.int64)
    total = len(labels)
    if not 0 < n < total:
        raise ValueError(f"a held-out part of {n} images out of the {total} of the training split leaves "
                         "nothing to train on or to validate with; set data.holdout between 1 and "
                         f"{total - 1}")
    classes, counts = torch.unique(labels, return_counts=True)
    exact = counts.double() * n / total
    share = exact.floor().long()
    left = n - int(share.sum())
    share[torch.argsort(exact - share, descending=True, stable=True)[:left]] += 1
    g = torch.Generator().manual_seed(seed)
    chosen = []
    for c, k in zip(classes.tolist(), share.tolist(), strict=True):
        members = torch.nonzero(labels == c).flatten()
        chosen.append(members[torch.randperm(len(members), generator=g)[:k]])
    return sorted(torch.cat(chosen).tolist())


def holdout_split(dataset: Dataset, n: int, seed: int = HOLDOUT_SEED) -> tuple[Dataset, Dataset]:
    """(the rest, the held-out part): `n` items of `dataset` held out, class by class (holdout_indices),
    both parts keeping its fast path. The dataset must tell its labels (`.targets`)."""
    labels = getattr(dataset, "targets", None)
    if labels is None:
        raise ValueError(f"{type(dataset).__name__} does not tell its labels (.targets), so no part of it "
                         "can be held out class by class; give the data a val/ split, or set "
                         "data.val_split=''")
    held = holdout_indices(labels, n, seed)
    kept = sorted(set(range(len(dataset))) - set(held))
    return take(dataset, kept), take(dataset, held)


def balanced_indices(labels: torch.Tensor, n: int, num_classes: int, seed: int = 0) -> list[int]:
    """`n` indices holding n / num_classes items of every class, drawn at random (torch generator `seed`)
    and returned in order. For one seed the subsets are nested (the 1,000 lie inside the 3,000): each class
    takes the first ones of one fixed permutation. Data-scaling studies train on these, so that a small set
    keeps every class's share. ValueError when n is not a multiple of num_classes or a class is too small."""
    if n < 1 or n % num_classes:
        raise ValueError(f"a balanced subset of {n} images needs a positive multiple of the {num_classes} "
                         "classes; pick another size")
    per_class = n // num_classes
    g = torch.Generator().manual_seed(seed)
    chosen = []
    for c in range(num_classes):
        members = torch.nonzero(labels == c).flatten()
        if len(members) < per_class:
            raise ValueError(f"class {c} has {len(members)} images, fewer than the {per_class} a balanced "
                             f"subset of {n} needs; pick a smaller size")
        chosen.append(members[torch.randperm(len(members), generator=g)[:per_class]])
    return sorted(torch.cat(chosen).tolist())
