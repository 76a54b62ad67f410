"""The order in which a run sees its data, as pure functions of (seed, epoch, step, ...): how a global batch
is split over processes and micro-batches (`BatchPlan`), the permutation of an epoch, each process's indices
of a step, each image's random stream (vitkit.streams) and the seed of a per-image transform. batches.py and
shard_batches.py make batches from them; their docstrings say why resuming from (epoch, step) is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..streams import image_streams

# A micro-batch: images, labels (integers, or soft labels after MixUp/CutMix) and each image's random stream.
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_MIX = 1_000_003  # a prime, to spread (seed, epoch, step, ...) over the seed space


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch is split: `world` processes x `accum` micro-batches of
    `micro`."""

    global_batch: int
    world: int
    rank: int
    micro: int

    def __post_init__(self) -> None:
        per_rank, rest = divmod(self.global_batch, self.world)
        if rest or per_rank % self.micro:
            raise ValueError(f"batch_size={self.global_batch} must be a multiple of processes ({self.world}) "
                             f"x micro_batch ({self.micro})")

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.world

    @property
    def accum(self) -> int:
        return self.per_rank // self.micro


def make_plan(global_batch: int, micro_batch: int, world: int, rank: int) -> BatchPlan:
    """micro_batch 0 means one micro-batch per process per step (no accumulation)."""
    if not micro_batch and global_batch % max(world, 1):
        raise ValueError(f"batch_size={global_batch} must be a multiple of the number of processes ({world})")
    micro = micro_batch or global_batch // max(world, 1)
    return BatchPlan(global_batch=global_batch, world=world, rank=rank, micro=micro)


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of range(n) that epoch `epoch` visits, a function of (seed, epoch) only."""
    g = torch.Generator().manual_seed(seed * _MIX + epoch)
    return torch.randperm(n, generator=g)


def steps_per_epoch(n: int, global_batch: int) -> int:
    if n < global_batch:
        raise ValueError(f"the training set has {n} images, fewer than one batch of {global_batch}; "
                         "lower batch_size")
    return n // global_batch


def rank_indices(order: torch.Tensor, step: int, plan: BatchPlan) -> list[torch.Tensor]:
    """This process's micro-batches (index tensors) of step `step` of the epoch."""
    start = step * plan.global_batch + plan.rank * plan.per_rank
    mine = order[start:start + plan.per_rank]
    return list(mine.split(plan.micro))


def first_position(plan: BatchPlan, micro: int) -> int:
    """The place in the global batch of the first image of this process's micro-batch `micro`."""
    return plan.rank * plan.per_rank + micro * plan.micro


def micro_batch_streams(seed: int, epoch: int, step: int, plan: BatchPlan, micro: int) -> torch.Tensor:
    """The random streams (B, 2) of the images of this process's micro-batch `micro` of step `step`: keyed by
    their places in the global batch, so the same on any number of processes."""
    first = first_position(plan, micro)
    return image_streams(seed, epoch, step, torch.arange(first, first + plan.micro))


def sample_seed(seed: int, epoch: int, step: int, position: int) -> int:
    """The seed of torch's generator while the per-image transform (torchvision v2) of the image at `position`
    of step `step`'s global batch runs."""
    return ((((seed * _MIX + epoch) * _MIX + step) * _MIX + position) * 131 + 127) % (2**63 - 1)
