r"""How close to the CPU's limit does each engine run a ViT? The arithmetic peak of each precision, measured
on this machine (vitkit.cpu.peak: one multiply-add instruction on every thread, nothing else), beside what the
libraries' products reach alone at a ViT's shapes, and, read off `vitkit bench --runtimes` records, what
fraction of the peak each contender's whole call reached, and the fraction that `optimize` would need for its
targets against the faster of OpenVINO and ONNX Runtime (1.05x at fp32, 1.1x at bf16 and int8).

    .venv/bin/python benchmarks/bench_peak.py --threads 2 \
        --runtimes benchmarks/results/infer-runtimes_amd-epyc_2026-12-05_settled-run1.json ... \
        --json benchmarks/results/peak_amd-epyc_DATE.json

The record renders as the `peak` table of docs/speed.md (benchmarks/render_tables.py).

Take records of the same CPU kind (the peaks are measured now, the records' times then). `--isa avx2`
probes the AVX2 instructions only, for records made with the libraries held to AVX2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from vitkit.bench import RUNTIME_RIVALS, machine_info, write_json
from vitkit.cpu import peak

sys.path.insert(0, str(Path(__file__).resolve().parent))
from render_tables import peak_table  # noqa: E402

# The precision each of optimize's models and its runtime rivals compute in, read off the rivals' names
# ("ort-int8"); every other contender (the eager and compiled anchors) computes in fp32.
PRECISION = {name: rivals[0].rsplit("-", 1)[1]
             for ours, rivals in RUNTIME_RIVALS.items() for name in (ours, *rivals)}
TARGETS = {"vitkit-fp32-opt": 1.05, "vitkit-int8": 1.1, "vitkit-bf16": 1.1}  # x the faster runtime
# (rows, in, out) of ViT-S/16's layers at batch 1 (197 tokens): q;k;v, fc1, fc2
SHAPES = ((197, 384, 1152), (197, 384, 1536), (197, 1536, 384))


def precision_of(contender: str) -> str:
    return PRECISION.get(contender, "fp32")


def best_seconds(fn: Callable[[], object], calls: int = 50, repeats: int = 10) -> float:
    """The fastest of `repeats` means over `calls` calls, after a few untimed ones."""
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def layer_call(precision: str, m: int, k: int, n: int) -> Callable[[], object]:
    """A call of the k -> n linear layer vitkit's `optimize` builds at `precision` on m rows: oneDNN-packed
    fp32 or bf16 (vitkit.cpu.packed), int8 on vitkit's VNNI product where it runs, else PyTorch's dynamic
    int8 (DynamicInt8Linear; the activations' quantisation included)."""
    from vitkit.cpu.int8 import DynamicInt8Linear
    from vitkit.cpu.packed import PackedLinear

    linear, x = nn.Linear(k, n), torch.randn(m, k)
    if precision == "int8":
        layer: nn.Module = DynamicInt8Linear(linear)
    else:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        layer, x = PackedLinear(linear.to(dtype)), x.to(dtype)
    return lambda: layer(x)


def product_rates(precision: str) -> list[dict]:
    """The rate of `layer_call` on each of SHAPES, alone (its weight warm in the caches)."""
    rows = []
    for m, k, n in SHAPES:
        call = layer_call(precision, m, k, n)
        with torch.no_grad():
            seconds = best_seconds(call)
        rows.append({"shape": [m, k, n], "gops": 2 * m * k * n / seconds / 1e9})
    return rows


def read_rows(paths: list[Path]) -> list[dict]:
    """The rows of `vitkit bench --runtimes` records, each with its record's name."""
    rows = []
    for path in paths:
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"error: {path}: {e}") from None
        if not any(r.get("vs_best_runtime") is not None for r in report.get("rows", [])):
            raise SystemExit(f"error: {path} is not a `vitkit bench --runtimes` record (no vs_best_runtime)")
        rows += [dict(r, record=path.name) for r in report["rows"]]
    return rows


def of_peak(rows: list[dict], peaks: dict[str, dict]) -> list[dict]:
    """Per record, cell and contender: its whole call's rate over its precision's peak; for optimize's models
    also the fraction its target would need (target x the faster runtime's rate, which is the contender's
    rate / vs_best_runtime x target)."""
    out = []
    for r in rows:
        precision = precision_of(r["contender"])
        if precision not in peaks:
            continue
        top = peaks[precision]["gops"]
        row = {"record": r["record"], "model": r["model"], "batch": r["batch"], "contender": r["contender"],
               "precision": precision, "gops": r["gflops"], "of_peak": r["gflops"] / top}
        ratio, target = r.get("vs_best_runtime"), TARGETS.get(r["contender"])
        if ratio and target:
            row["target"] = target
            row["target_of_peak"] = r["gflops"] / ratio * target / top
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="threads of the probes and products")
    parser.add_argument("--isa", choices=["", "avx2"], default="",
                        help="'avx2': probe AVX2 instructions only")
    parser.add_argument("--seconds", type=float, default=0.5, help="length of each probe call")
    parser.add_argument("--runtimes", type=Path, nargs="*", default=[],
                        help="`vitkit bench --runtimes` records to place against the peaks")
    parser.add_argument("--json", type=Path, help="write the record here")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads {args.threads}: must be at least 1")
    rows = read_rows(args.runtimes)
    torch.set_num_threads(args.threads)
    peaks = peak.peaks(seconds=args.seconds, repeats=5, isa=args.isa)
    report = {
        "machine": machine_info(), "threads": args.threads, "isa": args.isa or "native",
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "peaks": peaks,
        "products": {p: product_rates(p) for p in peaks},
        "cells": of_peak(rows, peaks), "records": [p.name for p in args.runtimes],
    }
    text = peak_table(report) + "\n"
    sys.stdout.write(text)
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
