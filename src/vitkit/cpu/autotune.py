"""Which kernel computes an operation of a given shape: the fastest on this machine, timed once, cached on
disk.

As `torch.backends.cudnn.benchmark` does for convolutions, the first call of an operation at a new shape times
each candidate implementation on tensors of that shape (interleaved rounds; each candidate's fastest round,
the figure least disturbed by other work on the machine) and keeps the fastest. The caller's default (its
fixed rule) is kept unless another candidate is at least `MARGIN` faster, and PyTorch's own implementation is
always among the candidates, so a tuned path is never slower than PyTorch's beyond that margin. The choice is
kept for the process and written to a JSON file per CPU model and vector extension, PyTorch version and
thread count (`$VITKIT_CACHE_DIR` or `~/.cache/vitkit`, file `autotune-<cpu>-<isa>-torch<version>.json`: a
hypervisor's "AMD EPYC" may be an AVX2 or an AVX-512 CPU), so later processes on
the machine (a resumed run among them) make the same choice without timing again. The first choice written
for a shape wins: processes that tune at once (those of a data-parallel run) take the one written first.

`VITKIT_AUTOTUNE=0` turns timing off: every operation then takes the default its caller names (a fixed rule).
The candidates run on tensors drawn from a generator of their own, so tuning leaves the global random stream,
and with it a training run's, untouched.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
import warnings
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

import torch

from .hardware import cpu_isa, cpu_model

ENV = "VITKIT_AUTOTUNE"
CACHE_ENV = "VITKIT_CACHE_DIR"
# A candidate must beat the default by this fraction to be chosen instead.
MARGIN = 0.05
# Timing of one decision: at least MIN_ROUNDS interleaved rounds, more while under BUDGET_S, at most
# MAX_ROUNDS.
MIN_ROUNDS, MAX_ROUNDS, BUDGET_S = 5, 40, 0.15

_choices: dict[str, str] = {}  # the cache file's, once read
_loaded_from: Path | None = None
# the choices made or read in this process, by (cache folder, op, shape, threads)
_memo: dict[tuple, str] = {}


def enabled() -> bool:
    """False when the environment turns timing off (VITKIT_AUTOTUNE=0, false, no, off)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_path() -> Path:
    """This machine's cache file: per CPU model, vector extension and PyTorch version, under $VITKIT_CACHE_DIR
    or ~/.cache/vitkit."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "vitkit")
    cpu = "-".join(filter(None, (cpu_model() or "unknown-cpu", cpu_isa())))
    cpu = re.sub(r"[^a-z0-9]+", "-", cpu.lower()).strip("-")
    return root / f"autotune-{cpu}-torch{torch.__version__.split('+')[0]}.json"


def _read(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("choices"), dict):
            return {str(k): str(v) for k, v in data["choices"].items()}
        raise ValueError("no 'choices' table")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"vitkit: ignoring the unreadable autotuning cache {path} ({e}); it is written anew",
                      RuntimeWarning, stacklevel=4)
        return {}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside `path`, so that processes tuning at once merge their choices, not clobber
    them."""
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _load() -> None:
    global _loaded_from
    path = cache_path()
    if _loaded_from != path:
        _choices.clear()
        _choices.update(_read(path))
        _loaded_from = path


def _store(key: str, choice: str) -> str:
    """Write `choice` for `key` into the cache file and return it; where another process has written a choice
    for `key` meanwhile (the processes of a data-parallel run tune at once), that one, so that they agree."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            stored = _read(path)
            if key in stored:
                return stored[key]
            stored[key] = choice
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"cpu": cpu_model(), "torch": torch.__version__, "choices": stored},
                                      indent=1, sort_keys=True))
            os.replace(tmp, path)
    except OSError as e:  # a read-only home: the choice holds for this process only
        warnings.warn(f"vitkit: cannot write the autotuning cache {path} ({e}); choices last for this "
                      "process",
                      RuntimeWarning, stacklevel=3)
    return choice


def time_candidates(candidates: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """The fastest round's seconds of each candidate over interleaved rounds (after one untimed call each)."""
    for fn in candidates.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    start = time.perf_counter()
    for r in range(MAX_ROUNDS):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order: no one always first
            t = time.perf_counter()
            candidates[name]()
            samples[name].append(time.perf_counter() - t)
        if r + 1 >= MIN_ROUNDS and time.perf_counter() - start > BUDGET_S:
            break
    return {name: min(s) for name, s in samples.items()}


def pick(times: dict[str, float], default: str) -> str:
    """The fastest candidate, unless it beats `default` by less than MARGIN: then `default`."""
    best = min(times, key=times.__getitem__)
    return best if times[best] < (1.0 - MARGIN) * times[default] else default


def choose(op: str, shape: Hashable, candidates: Callable[[], dict[str, Callable[[], Any]]],
           default: str) -> str:
    """The implementation of operation `op` at `shape`: the cached choice, else (tuning on) the fastest of
    `candidates()` (a dict of callables that includes PyTorch's own implementation and `default`, made only
    when needed; `pick`), else `default`. The key holds the thread count too."""
    if not enabled():
        return default
    memo = (os.environ.get(CACHE_ENV), op, shape, torch.get_num_threads())
    choice = _memo.get(memo)
    if choice is not None:  # the common case, once per call of a layer: a dictionary look-up
        return choice
    key = _key(op, shape, memo[3])
    _load()
    choice = _choices.get(key)
    if choice is not None:
        _memo[memo] = choice
        return choice
    calls = candidates()
    if len(calls) == 1:  # nothing to time: kept for the process (not on disk: another may have more)
        _memo[memo] = choice = next(iter(calls))
        return choice
    # Candidates may draw (dropout): the global stream is kept as it was. They save tensors for their own
    # backward passes: plain hooks keep those out of an activation checkpoint around the layer, which
    # would otherwise count them as the layer's (and recompute the layer when they are read).
    with torch.random.fork_rng(devices=[]), torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
        choice = pick(time_candidates(calls), default if default in calls else next(iter(calls)))
    choice = _store(key, choice)
    _choices[key] = _memo[memo] = choice
    return choice


def _key(op: str, shape: Hashable, threads: int) -> str:
    """A decision's key in the cache file: the operation, the shape and the thread count."""
    return f"{op}|{shape}|t{threads}"


def chosen(op: str) -> dict[str, str]:
    """The choices of operation `op` this process has made, read or had alone so far, as the cache file's
    keys less the operation ("shape|tTHREADS") -> choice: what a benchmark record names as the kernels its
    figures ran on."""
    return {_key(op, shape, threads).removeprefix(f"{op}|"): choice
            for (_, o, shape, threads), choice in _memo.items() if o == op}


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def generator() -> torch.Generator:
    """A generator of its own for the candidates' tensors (the global random stream is left alone)."""
    return torch.Generator().manual_seed(0)


def forget() -> None:
    """Drop this process's choices (the cache file is read again on the next decision); for tests."""
    global _loaded_from
    _choices.clear()
    _memo.clear()
    _loaded_from = None
