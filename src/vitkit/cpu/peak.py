"""The CPU's arithmetic limit at each precision, measured: how close a product, or a whole model, comes to
what the cores can compute at all.

`peak_rate(kind)` times torch.ops.vitkit.peak_ops (csrc/peak.cpp): every thread of torch's pool runs one
vector multiply-add instruction on independent accumulators and nothing else, so the rate is that
instruction's throughput at the clock the cores hold under the load. `peaks()` takes, for fp32, bf16 and int8,
the widest instruction this CPU has for the precision (VNNI's vpdpbusd for int8 where there is one, else
AVX2's three-instruction sequence; bf16 only with AVX512-BF16, which the CPU otherwise emulates). Ops count
multiplies and adds apart, as a model's FLOP count does. AMX is not probed: on CPUs with it (Intel Sapphire
Rapids and later) oneDNN's bf16 and int8 products run on its tiles, faster than the AVX-512 figure given here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from .build import peak_available
from .hardware import cpu_flags

# The probes, widest first within a precision: (precision, the CPU flags it needs).
PROBES: dict[str, tuple[str, frozenset[str]]] = {
    "fp32-avx512": ("fp32", frozenset({"avx512f"})),
    "fp32-avx2": ("fp32", frozenset({"avx2", "fma"})),
    "bf16-avx512": ("bf16", frozenset({"avx512f", "avx512_bf16"})),
    "int8-avx512": ("int8", frozenset({"avx512f", "avx512_vnni"})),
    "int8-avxvnni": ("int8", frozenset({"avx2", "avx_vnni"})),
    "int8-avx2": ("int8", frozenset({"avx2"})),
}


def kinds_here(flags: Iterable[str] | None = None, isa: str = "") -> list[str]:
    """The probes a CPU with `flags` (default: this one's) can run; `isa="avx2"` leaves out the AVX-512 ones,
    as for a run whose libraries are held to AVX2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2)."""
    if isa not in ("", "avx2"):
        raise ValueError(f"isa={isa!r}: '' (all the CPU has) or 'avx2'")
    have = frozenset(cpu_flags() if flags is None else flags)
    return [k for k, (_, needs) in PROBES.items() if needs <= have and not (isa and "avx512" in k)]


def best_kinds(flags: Iterable[str] | None = None, isa: str = "") -> dict[str, str]:
    """For each precision the CPU computes natively, its widest probe: {"fp32": "fp32-avx512", ...}."""
    best: dict[str, str] = {}
    for kind in kinds_here(flags, isa):
        best.setdefault(PROBES[kind][0], kind)
    return best


def peak_rate(kind: str, seconds: float = 0.2, repeats: int = 3) -> float:
    """Ops per second of probe `kind` on torch's intra-op threads: the best of `repeats` calls of at least
    `seconds` / 2 each (the best, as a limit: a slower call is one the machine interrupted), after shorter
    calls that size them."""
    if kind not in PROBES:
        raise ValueError(f"unknown probe {kind!r}: one of {', '.join(PROBES)}")
    if kind not in kinds_here():
        lacks = ", ".join(sorted(PROBES[kind][1] - cpu_flags()))
        raise ValueError(f"this CPU lacks {lacks} for probe {kind!r}")
    if not peak_available():
        raise RuntimeError("the peak probe (torch.ops.vitkit.peak_ops) is unavailable: compiled operators "
                           "are off (VITKIT_KERNELS=0) or its build failed (the warning above says why)")
    if seconds <= 0 or repeats < 1:
        raise ValueError(f"seconds={seconds} and repeats={repeats} must be positive")
    iterations, best, timed = 100_000, 0.0, 0
    while timed < repeats:
        start = time.perf_counter()
        ops = torch.ops.vitkit.peak_ops(kind, iterations)
        took = time.perf_counter() - start
        if took >= seconds / 2:  # long enough that a thread's late start is lost in it: a timed call
            best, timed = max(best, ops / took), timed + 1
        # Sized to `seconds` from this call, never shrunk: a call slowed by the machine would shrink it to
        # calls too short to time.
        iterations = max(iterations, round(iterations * seconds / took))
    return best


def peaks(seconds: float = 0.2, repeats: int = 3, isa: str = "") -> dict[str, dict[str, float | str]]:
    """{precision: {"kind": probe, "gops": 1e9 ops per second}} for each precision this CPU computes natively,
    on torch's intra-op threads."""
    return {precision: {"kind": kind, "gops": peak_rate(kind, seconds, repeats) / 1e9}
            for precision, kind in best_kinds(isa=isa).items()}
