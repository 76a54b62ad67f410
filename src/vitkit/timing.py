"""Timing calls side by side on a shared machine: rounds interleaved in a fresh random order, ratios paired
within each round, and each contender run on its own warm threads (`interleaved_times`, `paired_ratio`)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any


def paired_ratio(seconds: list[float], references: list[list[float]]) -> float:
    """How many times faster than the references a contender is, as the median over rounds of (the fastest
    reference's time in that round / the contender's time in that round).

    A shared machine switches between busy and quiet phases lasting seconds to minutes. Each round calls every
    contender once, close together in time, so a ratio within a round compares like with like; a ratio of
    medians does not when a contender's median falls in a busy phase and its rival's in a quiet one."""
    if not references or any(len(r) != len(seconds) for r in references):
        raise ValueError("paired_ratio needs reference times for the same rounds as the contender's")
    return statistics.median(min(r[i] for r in references) / t for i, t in enumerate(seconds))


def timed(fn: Callable[[], Any]) -> float:
    """The seconds one call of `fn` takes, by the wall clock."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved_times(calls: dict[str, Callable[[], Any]], repeats: int, warmup: int, rng: random.Random,
                      progress: Callable[[], None] | None = None, settle: int = 0,
                      pause: float = 0.0) -> dict[str, list[float]]:
    """Time every call `repeats` times, in a fresh random order each round, after `warmup` untimed rounds.

    Before each timed call: a `pause` of that many seconds, then `settle` untimed calls of the same
    contender. A runtime's worker threads keep spinning after its call returns (ONNX Runtime's for 50-100 ms
    on 2 busy cores, libgomp's for PyTorch a few ms), and a call timed beside them shares the cores: on 2
    cores a ViT-S/16 batch-1 call of any engine ran up to 2.4x slower right after ONNX Runtime's than after
    its own. The pause lets them stop, the settle call wakes the contender's own threads, and the timed call
    runs as the engine runs when it serves alone."""
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for _ in range(repeats):
        rng.shuffle(names)
        for name in names:
            if pause > 0:
                time.sleep(pause)
            for _ in range(settle):
                calls[name]()
            times[name].append(timed(calls[name]))
            if progress:
                progress()
    return times
