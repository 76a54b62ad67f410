"""The batches of a run trained on tar shards (`data.name=shards:PATTERN`), in an order that resumes exactly.

The epoch's sequence of samples is a function of (seed, epoch) and the shards' counts, which every process
reads from index.json without opening a tar: the shards in a permuted order, and within each shard its
samples in a permuted order (drawn from seed, epoch and the shard). Process r of W takes the r-th contiguous
1/W of that sequence, so it reads about 1/W of the shards (the one or two at each end of its part are shared
with a neighbour, which decodes the other samples). Every process runs the same n // batch_size steps per
epoch, as for any other dataset (batches.py); step s of process r is items [s*p, (s+1)*p) of its part (p =
batch_size / W), cut into micro-batches of `micro`. What is left at the end of each part is dropped.

Micro-batch i of the epoch is made by DataLoader worker i mod `workers` (counted from the first one made),
which streams the shards of its micro-batches with webdataset's tar iterator, keeps the bytes of its own
samples only, then decodes and augments them, each image with torch's generator seeded by (seed, epoch,
step, its place in the global batch) as batches.py does. So the content of every micro-batch is a function
of (seed, epoch, step, W, rank) alone: resuming at (epoch, step) skips to it by arithmetic, with no reader
state, for any number of workers, and no sample of the epoch is seen twice or skipped.

With another number of processes than the run was checkpointed with, the epoch's sequence is cut differently:
the remaining steps of the interrupted epoch are those of the new cut (some samples of that epoch may then
come twice and others not at all); the epochs after it are whole.

`VITKIT_KEY_LOG=DIR` makes each process append, before each step, the keys of the samples it trains on to
DIR/keys-rank-R.tsv (epoch, step, shard/key per line): the record that a resumed epoch is exact.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..config import ViTConfig
from ..data.augment import AugmentConfig
from ..data.mixing import mix_pairs
from ..data.shards import ShardSet, decode_sample, read_shard
from ..data.transforms import build_train_transform
from .order import _MIX, Batch, BatchPlan, first_position, micro_batch_streams, sample_seed
from .stopping import ignore_stop_signals

KEY_LOG_ENV = "VITKIT_KEY_LOG"


def shard_order(num_shards: int, seed: int, epoch: int) -> torch.Tensor:
    """The order in which epoch `epoch` visits the shards."""
    return torch.randperm(num_shards, generator=torch.Generator().manual_seed((seed * _MIX + epoch) * 7 + 1))


def sample_order(count: int, seed: int, epoch: int, shard: int) -> torch.Tensor:
    """The order in which epoch `epoch` visits the samples of shard `shard` (positions in its tar)."""
    key = ((seed * _MIX + epoch) * _MIX + shard) * 7 + 2
    return torch.randperm(count, generator=torch.Generator().manual_seed(key % (2**63 - 1)))


def process_samples(counts: list[int] | tuple[int, ...], seed: int, epoch: int, plan: BatchPlan,
                    num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Process `plan.rank`'s samples of the epoch as (shard index, position in the shard), num_steps *
    plan.per_rank of them: items [rank * (n // world), ...) of the epoch's sequence (see the module)."""
    length = num_steps * plan.per_rank
    start = plan.rank * (sum(counts) // plan.world)
    if length > sum(counts) // plan.world:
        raise ValueError(f"{num_steps} steps of {plan.per_rank} images per process need more than the "
                         f"{sum(counts)} samples of the shards")
    shards, positions, offset = [], [], 0
    for k in shard_order(len(counts), seed, epoch).tolist():
        lo, hi = max(start, offset), min(start + length, offset + counts[k])
        if lo < hi:
            order = sample_order(counts[k], seed, epoch, k)[lo - offset:hi - offset]
            shards.append(torch.full_like(order, k))
            positions.append(order)
        offset += counts[k]
        if offset >= start + length:
            break
    if not shards:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    return torch.cat(shards), torch.cat(positions)


def worker_micro_batches(first: int, last: int, worker: int, workers: int) -> range:
    """The micro-batches (epoch-wide indices first .. last - 1) that DataLoader worker `worker` makes: the
    loader takes one from each worker in turn, starting with worker 0."""
    return range(first + worker, last, workers)


class _ShardMicroBatches(IterableDataset):
    """One process's micro-batches of steps start_step .. num_steps - 1, as (images, labels, keys); each
    DataLoader worker makes its share (worker_micro_batches)."""

    def __init__(self, shards: ShardSet, transform: Callable, seed: int, epoch: int, plan: BatchPlan,
                 start_step: int, num_steps: int):
        self.shards, self.transform, self.seed, self.epoch = shards, transform, seed, epoch
        self.plan, self.start, self.stop = plan, start_step, num_steps
        self.mode = "L" if shards.num_channels == 1 else "RGB"

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[str]]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        shard_ids, positions = process_samples(self.shards.counts, self.seed, self.epoch, self.plan,
                                               self.stop)
        micro, accum = self.plan.micro, self.plan.accum
        mine = worker_micro_batches(self.start * accum, self.stop * accum, worker, workers)
        wanted: dict[int, set[int]] = {}  # shard -> the positions this worker decodes
        last_use: dict[int, int] = {}  # shard -> the last micro-batch that needs it
        for i in mine:
            for k, j in zip(shard_ids[i * micro:(i + 1) * micro].tolist(),
                            positions[i * micro:(i + 1) * micro].tolist(), strict=True):
                wanted.setdefault(k, set()).add(j)
                last_use[k] = i
        held: dict[int, dict[int, dict]] = {}  # at most the two shards a micro-batch can straddle
        for i in mine:
            items = []
            for k, j in zip(shard_ids[i * micro:(i + 1) * micro].tolist(),
                            positions[i * micro:(i + 1) * micro].tolist(), strict=True):
                if k not in held:
                    held[k] = read_shard(self.shards.paths[k], wanted[k])
                items.append((k, held[k][j]))
            yield self._make(i, items)
            for k in [k for k in held if last_use[k] <= i]:
                del held[k]

    def _make(self, i: int, items: list[tuple[int, dict]]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """Micro-batch `i`: its samples decoded and augmented, each image with its own seeded generator."""
        step, j = divmod(i, self.plan.accum)
        first = first_position(self.plan, j)  # its place in the global batch
        images, labels, keys = [], [], []
        for n, (k, sample) in enumerate(items):
            name = self.shards.paths[k].name
            image, label = decode_sample(sample, self.mode, f"{name}:")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(sample_seed(self.seed, self.epoch, step, first + n))
                images.append(self.transform(image))
            labels.append(label)
            keys.append(f"{name}/{sample['__key__']}")
        return torch.stack(images), torch.tensor(labels, dtype=torch.int64), keys


class ShardBatches:
    """Batches of a ShardSet (see the module's docstring), in `workers` DataLoader processes."""

    def __init__(self, shards: ShardSet, model_cfg: ViTConfig, aug: AugmentConfig, num_classes: int,
                 seed: int, workers: int = 0):
        self.shards, self.seed, self.workers = shards, seed, workers
        self.transform = build_train_transform(model_cfg, aug)
        self.aug, self.num_classes = aug, num_classes
        self.key_log = os.environ.get(KEY_LOG_ENV) or None

    def __len__(self) -> int:
        return len(self.shards)

    def epoch(self, epoch: int, plan: BatchPlan, start_step: int,
              num_steps: int) -> Iterator[tuple[int, list[Batch]]]:
        data = _ShardMicroBatches(self.shards, self.transform, self.seed, epoch, plan, start_step, num_steps)
        # batch_size=None: each worker yields whole micro-batches. The loader's own generator leaves the
        # global RNG alone (as in batches.LoaderBatches).
        loader = DataLoader(data, batch_size=None, num_workers=self.workers, persistent_workers=False,
                            worker_init_fn=ignore_stop_signals,
                            generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
        it = iter(loader)
        for step in range(start_step, num_steps):
            micro_batches, keys = [], []
            for j in range(plan.accum):
                x, y, k = next(it)
                streams = micro_batch_streams(self.seed, epoch, step, plan, j)
                x, y = mix_pairs(x, y, streams, first_position(plan, j), self.aug, self.num_classes)
                micro_batches.append((x, y, streams))
                keys += k
            if self.key_log:
                log_keys(Path(self.key_log), plan.rank, epoch, step, keys)
            yield step, micro_batches


def log_keys(folder: Path, rank: int, epoch: int, step: int, keys: list[str]) -> None:
    """Append a step's sample keys to folder/keys-rank-R.tsv, flushed, so that a killed run keeps them."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"keys-rank-{rank}.tsv", "a") as f:
        f.writelines(f"{epoch}\t{step}\t{key}\n" for key in keys)
