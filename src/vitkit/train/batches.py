"""The order in which a run sees its data, and the batches each process trains on.

The order of an epoch is a permutation drawn from (seed, epoch) alone, so a resumed run replays it exactly and
every process computes the same one without talking to the others. Step s of the epoch takes the global batch
order[s*B : (s+1)*B] (the last incomplete batch is dropped); process r of W takes the r-th contiguous 1/W of
it, cut into micro-batches for gradient accumulation. The union over processes and micro-batches is the global
batch, which is why W processes with accumulation compute the gradient of one process with the whole batch.

Every random draw of a step belongs to an image and is keyed by (seed, epoch, step, the image's place in the
global batch) (vitkit.streams): the augmentation, random erasing, the MixUp/CutMix partner and its draws
(vitkit.data.mixing), and, through the stream each micro-batch carries to the model, drop-path and
PatchDropout. So a run draws the same for any number of processes and micro-batch size, no two images share a
draw, and resuming needs no random state. An in-memory micro-batch is augmented at once with each image's
stream (`vitkit.data.transforms.train_batch` with a `Draws`); an image of any other dataset goes through the
per-image transform with torch's generator seeded from the same four numbers, whichever DataLoader worker
makes it. Three sources of batches, each yielding (images, labels, streams) micro-batches:

* `MemoryBatches`, for datasets held as a uint8 tensor (Fashion-MNIST, CIFAR): whole batches are augmented at
  once, no worker processes. The fast path on a few CPU cores.
* `LoaderBatches`, for any other dataset (image folders): per-image torchvision v2 transforms in a DataLoader.
* `ShardBatches` (shard_batches.py), for tar shards: the same per-image transforms, streamed from the tars.

The plan and the seeds are pure functions in order.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from ..config import ViTConfig
from ..cpu.hardware import usable_cores
from ..data.augment import AugmentConfig
from ..data.mixing import mix_pairs
from ..data.shards import ShardSet
from ..data.transforms import build_train_transform, train_batch
from ..streams import AUGMENT, Draws, fold_in
from .order import (
    Batch,
    BatchPlan,
    epoch_order,
    first_position,
    make_plan,
    micro_batch_streams,
    rank_indices,
    sample_seed,
    steps_per_epoch,
)
from .shard_batches import ShardBatches
from .stopping import ignore_stop_signals

# The plan's names, which the trainer and the tests take from here.
__all__ = ["Batch", "BatchPlan", "LoaderBatches", "MemoryBatches", "ShardBatches", "batch_source",
           "epoch_order", "is_in_memory", "make_plan", "micro_batch_streams", "rank_indices", "sample_seed",
           "steps_per_epoch"]


def is_in_memory(dataset: Dataset) -> bool:
    images = getattr(dataset, "images", None)
    targets = getattr(dataset, "targets", None)
    return (torch.is_tensor(images) and images.dtype == torch.uint8 and images.ndim == 4
            and torch.is_tensor(targets) and len(targets) == len(images))


class MemoryBatches:
    """Batches of an in-memory uint8 dataset, augmented a whole batch at a time."""

    def __init__(self, dataset: Dataset, model_cfg: ViTConfig, aug: AugmentConfig, num_classes: int,
                 seed: int):
        self.images, self.targets = dataset.images, dataset.targets
        self.cfg, self.aug, self.seed, self.num_classes = model_cfg, aug, seed, num_classes

    def __len__(self) -> int:
        return len(self.images)

    def epoch(self, epoch: int, plan: BatchPlan, start_step: int,
              num_steps: int) -> Iterator[tuple[int, list[Batch]]]:
        order = epoch_order(len(self), self.seed, epoch)
        for step in range(start_step, num_steps):
            micro_batches = []
            for j, idx in enumerate(rank_indices(order, step, plan)):
                streams = micro_batch_streams(self.seed, epoch, step, plan, j)
                x = train_batch(self.images[idx], self.cfg, self.aug, Draws(fold_in(streams, AUGMENT)))
                x, y = mix_pairs(x, self.targets[idx], streams, first_position(plan, j), self.aug,
                                 self.num_classes)
                micro_batches.append((x, y, streams))
            yield step, micro_batches


class _IndexBatches(torch.utils.data.Sampler):
    """Yields this process's micro-batches, steps start_step .. num_steps - 1, as lists of (augmentation seed,
    index) pairs for _SeededItems."""

    def __init__(self, order: torch.Tensor, plan: BatchPlan, start_step: int, num_steps: int, seed: int,
                 epoch: int):
        self.order, self.plan, self.start, self.stop = order, plan, start_step, num_steps
        self.seed, self.epoch = seed, epoch

    def __iter__(self):
        for step in range(self.start, self.stop):
            for j, idx in enumerate(rank_indices(self.order, step, self.plan)):
                first = first_position(self.plan, j)  # the micro-batch's place in the global batch
                yield [(sample_seed(self.seed, self.epoch, step, first + i), index)
                       for i, index in enumerate(idx.tolist())]

    def __len__(self) -> int:
        return (self.stop - self.start) * self.plan.accum


class _SeededItems(Dataset):
    """dataset[index] with torch's generator seeded for that one item, and this process's generator left as
    it was: an image's random augmentation is the same in any worker process, and after any resume (a worker's
    generator would otherwise depend on which items it made before)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]):
        seed, index = item
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.dataset[index]


class LoaderBatches:
    """Batches of any dataset through per-image v2 transforms, in `workers` DataLoader processes."""

    def __init__(self, dataset: Dataset, model_cfg: ViTConfig, aug: AugmentConfig, num_classes: int,
                 seed: int, workers: int = 0):
        from ..data import TransformedDataset

        self.dataset = TransformedDataset(dataset, build_train_transform(model_cfg, aug))
        self.seed, self.workers, self.aug, self.num_classes = seed, workers, aug, num_classes

    def __len__(self) -> int:
        return len(self.dataset)

    def epoch(self, epoch: int, plan: BatchPlan, start_step: int,
              num_steps: int) -> Iterator[tuple[int, list[Batch]]]:
        order = epoch_order(len(self), self.seed, epoch)
        sampler = _IndexBatches(order, plan, start_step, num_steps, self.seed, epoch)
        # The loader's own generator: without one, each iterator draws its workers' base seed from the global
        # RNG (the items are seeded by _SeededItems; the base seed only has to leave the global RNG alone).
        loader = DataLoader(_SeededItems(self.dataset), batch_sampler=sampler, num_workers=self.workers,
                            persistent_workers=False, worker_init_fn=ignore_stop_signals,
                            generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
        it = iter(loader)
        for step in range(start_step, num_steps):
            micro_batches = []
            for j in range(plan.accum):
                x, y = next(it)
                streams = micro_batch_streams(self.seed, epoch, step, plan, j)
                x, y = mix_pairs(x, y, streams, first_position(plan, j), self.aug, self.num_classes)
                micro_batches.append((x, y, streams))
            yield step, micro_batches


def loader_workers(asked: int) -> int:
    """The DataLoader processes to start for `asked`: at most one per core this process may run on (more
    only compete with the training for the cores, and PyTorch warns about them). What is drawn does not
    depend on it: every image is seeded by its place in the run."""
    cores = usable_cores()
    return min(asked, cores)


def batch_source(dataset: Dataset | ShardSet, model_cfg: ViTConfig, aug: AugmentConfig, num_classes: int,
                 seed: int, workers: int = 0) -> MemoryBatches | LoaderBatches | ShardBatches:
    workers = loader_workers(workers)
    if isinstance(dataset, ShardSet):
        return ShardBatches(dataset, model_cfg, aug, num_classes, seed, workers)
    if is_in_memory(dataset):
        return MemoryBatches(dataset, model_cfg, aug, num_classes, seed)
    return LoaderBatches(dataset, model_cfg, aug, num_classes, seed, workers)
