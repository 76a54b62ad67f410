"""Counter-based random streams, one per image: a draw is a pure function of (seed, epoch, step, the image's
place in the global batch, what it is for, its index), the way big_vision folds the step and the device into
JAX keys. So an image's masks and augmentation are the same on 1 or 8 processes, in any micro-batch, after any
resume and on any device, and no two images (hence no two processes) share a draw.

A batch's streams are an int64 tensor (B, 2): two 32-bit keys per image (64 bits, so that the millions of
images of a run do not collide). `image_streams` makes them, `fold_in` derives an independent stream for one
purpose (an augmentation, block 3's drop-path, ...), `bits` and `uniform` draw n values per image, `beta` a
Beta variate per image, and `Draws` hands out successive draws for code written against a generator.

The mixing function is Chris Wellons' 32-bit `lowbias32` hash, computed in int64 lanes with products kept
below 2^49 (no overflow), so that it runs alike in eager PyTorch, under torch.compile and on any device, and
on plain Python ints.
"""

from __future__ import annotations

import math

import torch

M32 = 0xFFFF_FFFF
# What a stream is folded with for each use in training (vitkit.train): the per-image augmentation, the
# model's drop-path and PatchDropout, MixUp/CutMix, and the process's own generator for dropout.
AUGMENT, MODEL, MIX, DROPOUT = 1, 2, 3, 4


def _mul32(x, m: int):
    """(x * m) mod 2^32 for 0 <= x < 2^32, as two 16-bit halves of m: no intermediate reaches 2^49."""
    return (x * (m & 0xFFFF) + (((x * (m >> 16)) & 0xFFFF) << 16)) & M32


def mix32(x):
    """lowbias32 (Wellons, "Hash Prospector"): a bijection of 32-bit values that mixes every bit into every
    other. Takes the low 32 bits of `x` (an int or an int64 tensor)."""
    x = x & M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _fold(a, b, data):
    """fold_in on the two keys, as ints or int64 tensors alike."""
    a = mix32(a ^ mix32(data))
    return a, mix32(b ^ mix32(a ^ 0x85EBCA6B))


def fold_in(streams: torch.Tensor, data) -> torch.Tensor:
    """A new stream per image, independent of `streams` and of any other `data` folded into them: `data` is an
    int (one purpose for every image) or an int64 tensor (B,) (one value per image)."""
    return torch.stack(_fold(*streams.unbind(-1), data), dim=-1)


def image_streams(seed: int, epoch: int, step: int, positions: torch.Tensor) -> torch.Tensor:
    """The streams (B, 2) of the images at `positions` (int64 (B,)) of the global batch of step `step` of
    epoch `epoch`."""
    a, b = 0, 0
    for value in (seed, epoch, step):  # the same for every image: folded as Python ints
        a, b = _fold(a, b, int(value))
    return torch.stack(_fold(a, b, positions.to(torch.int64)), dim=-1)


def bits(streams: torch.Tensor, n: int, start: int = 0) -> torch.Tensor:
    """n random 32-bit values per image, int64 (B, n) in [0, 2^32): the draws start .. start + n - 1 of each
    stream."""
    a, b = (t.unsqueeze(-1) for t in streams.unbind(-1))
    index = torch.arange(start, start + n, dtype=torch.int64, device=streams.device)
    return mix32(a ^ mix32(b ^ mix32(index)))


def uniform(streams: torch.Tensor, n: int, start: int = 0) -> torch.Tensor:
    """n uniform draws per image in [0, 1), float32 (B, n): 24 random bits each (exact in float32)."""
    return (bits(streams, n, start) >> 8).to(torch.float32) * 2.0**-24


def open_uniform(streams: torch.Tensor, n: int) -> torch.Tensor:
    """n uniform draws per image in (0, 1), float64 (B, n), for logarithms: 32 random bits each, centred in
    their interval."""
    return (bits(streams, n).to(torch.float64) + 0.5) * 2.0**-32


# Marsaglia and Tsang's gamma sampler accepts at least 95 % of its candidates for any shape >= 1; with this
# many drawn at once, all are refused with probability below 0.05^16 < 1e-20.
GAMMA_CANDIDATES = 16


def gamma(streams: torch.Tensor, shape: float) -> torch.Tensor:
    """A Gamma(shape, 1) variate per image, float64 (B,), by Marsaglia and Tsang (2000), vectorised: a fixed
    number of candidates per image, the first accepted one taken; shape < 1 by their boost, Gamma(shape + 1)
    times U^(1 / shape)."""
    if not (shape > 0 and math.isfinite(shape)):
        raise ValueError(f"gamma shape={shape}: need a finite number > 0")
    a = shape + 1.0 if shape < 1 else shape
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    u = open_uniform(fold_in(streams, 0), 3 * GAMMA_CANDIDATES).unflatten(-1, (3, GAMMA_CANDIDATES))
    z = torch.sqrt(-2.0 * torch.log(u[..., 0, :])) * torch.cos(2.0 * math.pi * u[..., 1, :])  # Box-Muller
    v = (1.0 + c * z) ** 3
    log_v = torch.log(v.clamp(min=1e-300))
    accept = (v > 0) & (torch.log(u[..., 2, :]) < 0.5 * z * z + d - d * v + d * log_v)
    first = accept.to(torch.int64).argmax(dim=-1, keepdim=True)  # the first accepted (0 if none is)
    x = d * v.gather(-1, first).squeeze(-1)
    x = torch.where(accept.any(dim=-1), x, torch.full_like(x, d))
    if shape < 1:
        x = x * open_uniform(fold_in(streams, 1), 1).squeeze(-1) ** (1.0 / shape)
    return x


def beta(streams: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """A Beta(a, b) variate per image, float64 (B,): G_a / (G_a + G_b) of two independent gamma variates."""
    x, y = gamma(fold_in(streams, 1), a), gamma(fold_in(streams, 2), b)
    return x / (x + y)


class Draws:
    """Successive uniform draws for a batch, each image from its own stream: every image reads its stream's
    values in order, so its draws are the same whatever other images share the batch. Where augmentation code
    takes a torch.Generator, a Draws makes its draws per image instead (vitkit.data.transforms). The values
    are made `CHUNK` at a time: one hash over the batch instead of one per call."""

    CHUNK = 64

    def __init__(self, streams: torch.Tensor):
        self.streams = streams
        self.values = torch.empty(len(self), 0, device=streams.device)  # made, not yet handed out
        self.made = 0  # values made per image so far: the stream's next index

    def __len__(self) -> int:
        return self.streams.shape[0]

    def rand(self, *shape: int) -> torch.Tensor:
        """The next uniform draws in [0, 1), (B, *shape)."""
        n = math.prod(shape)
        if n > self.values.shape[1]:
            more = max(self.CHUNK, n - self.values.shape[1])
            fresh = uniform(self.streams, more, start=self.made)
            self.values = torch.cat([self.values, fresh], dim=1)
            self.made += more
        out, self.values = self.values[:, :n], self.values[:, n:]
        return out.reshape(len(self), *shape)
