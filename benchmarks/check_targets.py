"""vitkit's speed targets, read off the benchmark files of one or more runs: which hold in every run and which
do not, run by run, with the weakest cell of each.

A run is the files one full measurement writes (benchmarks/target_runs.sh writes them all into
benchmarks/results/): `vitkit bench --json` at batch 1 and at batch 16, `vitkit bench --runtimes --json`
(ONNX Runtime and OpenVINO beside `optimize`'s models), `benchmarks/bench_training.py --json`, and, where
measured, `benchmarks/bench_inference.py agreement --json`. Each file is recognised by what it holds.

    R=benchmarks/results
    python benchmarks/check_targets.py \\
        --run $R/infer-b1_amd-epyc_2026-12-02_run1.json,$R/infer-b16_amd-epyc_2026-12-02_run1.json,\\
$R/train-step_amd-epyc_2026-12-02_run1.json --run ... --markdown targets.md --json targets.json

The CPU targets only: the GPU figures and the ONNX export's check are not in these files (bench_gpu.py and
`vitkit export` report them).

Exit status: 0 when every target with figures holds in every run, 1 when one does not, 2 on a file it cannot
read. The targets were set on a CPU with VNNI (int8 at one instruction per 64 products); on a machine without
it the int8 target is out of reach by design, and the report says so rather than compare.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Cell = tuple[str, float]  # (where: "ViT-S/16 b1", value)


@dataclass
class Run:
    """The figures of one run: inference rows of `vitkit bench`, those of `vitkit bench --runtimes` (kept
    apart: their anchors are fewer, so their `vs_best_anchor` is not the eager targets'), training cells,
    agreement results."""

    name: str
    inference: list[dict]
    training: list[dict]
    agreement: list[dict]
    machines: list[dict]
    runtimes: list[dict]


@dataclass(frozen=True)
class Target:
    """One target: a threshold on the cells that `cells` picks out of a run."""

    text: str
    threshold: float
    cells: Callable[[Run], list[Cell]]
    unit: str = "x"  # "x" for ratios, "%" for fractions shown as percentages
    needs_vnni: bool = False


# The keys each kind of file's entries must have for the targets to be read off them.
REQUIRED_KEYS = {"inference": ("model", "batch", "contender"), "runtimes": ("model", "batch", "contender"),
                 "training": ("model", "batch"), "agreement": ()}

# The contenders that only `vitkit bench --runtimes` times (vitkit.bench.RUNTIME_CONTENDERS).
RUNTIME_CONTENDERS = ("timm-compiled", "ort-fp32", "ort-int8", "openvino-fp32", "openvino-bf16",
                      "openvino-int8")


class InputError(ValueError):
    """A file that is not one of the benchmark files this script reads."""


def inference_cells(contender: str, measure: str, model: str | None = None,
                    batch: int | None = None) -> Callable[[Run], list[Cell]]:
    def pick(run: Run) -> list[Cell]:
        return [(f"{r['model']} b{r['batch']}", float(r[measure])) for r in run.inference
                if r["contender"] == contender and r.get(measure) is not None
                and (model is None or r["model"] == model) and (batch is None or r["batch"] == batch)]
    return pick


def runtime_cells(contender: str) -> Callable[[Run], list[Cell]]:
    """`contender`'s ratio to the faster of ONNX Runtime and OpenVINO at its precision, per cell."""
    def pick(run: Run) -> list[Cell]:
        return [(f"{r['model']} b{r['batch']}", float(r["vs_best_runtime"])) for r in run.runtimes
                if r["contender"] == contender and r.get("vs_best_runtime") is not None]
    return pick


def training_cells(run: Run) -> list[Cell]:
    return [(f"{r['model']} b{r['batch']}", float(r["ratio_vitkit_over_timm"])) for r in run.training]


def compiled_training_cells(run: Run) -> list[Cell]:
    """The trainer's path for each cell against timm through torch.compile (files with compiled steps)."""
    key = "ratio_trainer_over_timm_compiled"
    return [(f"{r['model']} b{r['batch']}", float(r[key])) for r in run.training if key in r]


def agreement_cells(run: Run) -> list[Cell]:
    return [(Path(str(a.get("checkpoint", "checkpoint")).split()[0]).as_posix(),
             float(a["int8_top1_agreement_with_fp32"])) for a in run.agreement]


TARGETS: tuple[Target, ...] = (
    Target("`vitkit` (the model with its CPU modules) >= 1.0x the best anchor, every cell", 1.0,
           inference_cells("vitkit", "vs_best_anchor")),
    Target("`optimize(fp32)` >= 1.3x the best anchor at batch 1", 1.3,
           inference_cells("vitkit-fp32-opt", "vs_best_anchor", batch=1)),
    Target("`optimize(fp32)` >= 85 % of SGEMM peak, ViT-B/16 batch 16", 0.85,
           inference_cells("vitkit-fp32-opt", "mfu", model="ViT-B/16", batch=16), unit="%"),
    Target("`optimize(int8)` >= 2.5x the best fp32 anchor, every cell", 2.5,
           inference_cells("vitkit-int8", "vs_best_anchor"), needs_vnni=True),
    Target("int8 top-1 agreement with fp32 >= 99 %", 0.99, agreement_cells, unit="%"),
    Target("training step >= 1.1x timm", 1.1, training_cells),
    Target("training step (the trainer's path) >= 1.1x timm through torch.compile", 1.1,
           compiled_training_cells),
    Target("`optimize(fp32)` >= 1.05x the faster of OpenVINO and ONNX Runtime at fp32, every cell", 1.05,
           runtime_cells("vitkit-fp32-opt")),
    Target("`optimize(int8)` >= 1.1x the faster of OpenVINO and ONNX Runtime at int8, every cell", 1.1,
           runtime_cells("vitkit-int8")),
    Target("`optimize(bf16)` >= 1.1x OpenVINO at bf16, every cell (CPUs with native bf16)", 1.1,
           runtime_cells("vitkit-bf16")),
)


def classify(path: Path, data: object) -> str:
    """Which benchmark wrote this file: "inference", "training" or "agreement"."""
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        runtimes = any(isinstance(r, dict) and r.get("contender") in RUNTIME_CONTENDERS for r in data["rows"])
        return "runtimes" if runtimes else "inference"
    if isinstance(data, dict) and "int8_top1_agreement_with_fp32" in data:
        return "agreement"
    if isinstance(data, list) and data and all(isinstance(r, dict) and "ratio_vitkit_over_timm" in r
                                               for r in data):
        return "training"
    raise InputError(f"{path}: not a file of `vitkit bench --json`, benchmarks/bench_training.py --json or "
                     "benchmarks/bench_inference.py agreement --json")


def load_run(name: str, paths: list[Path]) -> Run:
    run = Run(name, [], [], [], [], [])
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise InputError(f"{path}: no such file") from None
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"{path}: cannot read it as JSON ({e})") from None
        kind = classify(path, data)
        entries = (data["rows"] if kind in ("inference", "runtimes") else data if kind == "training"
                   else [data])
        for entry in entries:
            missing = [k for k in REQUIRED_KEYS[kind] if not isinstance(entry, dict) or k not in entry]
            if missing:
                raise InputError(f"{path}: a {kind} entry without {', '.join(missing)}: {str(entry)[:80]}")
        getattr(run, kind).extend(entries)
        if kind in ("inference", "runtimes"):
            run.machines.append(data.get("machine", {}))
    return run


def shown(value: float, unit: str, threshold: float | None = None) -> str:
    """A ratio to 3 decimals or a fraction as a percentage to 1, with one more decimal where rounding would
    hide which side of the threshold the value is on (1.29993 is short of 1.3, not "1.300x")."""
    scale, digits, suffix = (100, 1, " %") if unit == "%" else (1, 3, "x")
    if threshold is not None and value < threshold:
        while f"{scale * value:.{digits}f}" == f"{scale * threshold:.{digits}f}" and digits < 8:
            digits += 1
    return f"{scale * value:.{digits}f}{suffix}"


def evaluate(target: Target, runs: list[Run]) -> dict:
    """Per run: every cell, the weakest, and whether all hold; then the verdict over the runs."""
    per_run = []
    for run in runs:
        cells = target.cells(run)
        worst = min(cells, key=lambda c: c[1]) if cells else None
        per_run.append({"run": run.name, "cells": dict(cells), "worst": worst,
                        "met": None if worst is None else worst[1] >= target.threshold})
    measured = [r for r in per_run if r["met"] is not None]
    short = [r for r in measured if not r["met"]]
    no_vnni = target.needs_vnni and any(m.get("vnni") is False for run in runs for m in run.machines)
    if not measured:
        verdict = "not measured"
    elif no_vnni:
        verdict = "not comparable: no VNNI on this machine"
    elif not short:
        verdict = "met"
    else:
        verdict = f"short in {len(short)} of {len(measured)} runs"
    return {"target": target.text, "threshold": target.threshold, "unit": target.unit, "runs": per_run,
            "verdict": verdict}


def machine_line(runs: list[Run]) -> str:
    machines = [m for run in runs for m in run.machines]
    if not machines:
        return "machine: not recorded (no `vitkit bench` file)"
    cpus = sorted({str(m.get("cpu", "?")) for m in machines})
    vnni = {m.get("vnni") for m in machines}
    threads = sorted({str(m.get("threads", "?")) for m in machines})
    vnni_text = ("yes" if vnni == {True} else "no" if vnni == {False} else "not recorded" if vnni == {None}
                 else "mixed")
    return f"machine: {', '.join(cpus)}; VNNI {vnni_text}; threads {', '.join(threads)}"


def markdown(results: list[dict], runs: list[Run]) -> str:
    head = "| target | " + " | ".join(run.name for run in runs) + " | verdict |"
    lines = [machine_line(runs), "", head, "|---|" + "---:|" * len(runs) + "---|"]
    for res in results:
        cells = []
        for r in res["runs"]:
            if r["worst"] is None:
                cells.append("-")
            else:
                where, value = r["worst"]
                text = f"{shown(value, res['unit'], res['threshold'])} ({where})"
                cells.append(text if r["met"] else f"**{text}**")
        lines.append(f"| {res['target']} | " + " | ".join(cells) + f" | {res['verdict']} |")
    lines += ["", "Each run's cell is its weakest; bold: below the target."]
    return "\n".join(lines) + "\n"


def check(run_specs: list[str]) -> tuple[list[dict], list[Run]]:
    runs = [load_run(f"run {i}", [Path(p) for p in spec.split(",") if p])
            for i, spec in enumerate(run_specs, 1)]
    return [evaluate(t, runs) for t in TARGETS], runs


def all_met(results: list[dict]) -> bool:
    return all(r["verdict"] in ("met", "not measured") for r in results)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, metavar="FILE[,FILE...]",
                   help="the JSON files of one run, comma-separated; repeat for each run")
    p.add_argument("--markdown", default=None, help="also write the table here")
    p.add_argument("--json", default=None, help="also write every cell and verdict here")
    args = p.parse_args(argv)
    try:
        results, runs = check(args.run)
    except InputError as e:
        print(f"check_targets: {e}", file=sys.stderr)
        return 2
    table = markdown(results, runs)
    print(table, end="")
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_line(runs), "targets": results},
                                              indent=1) + "\n")
    return 0 if all_met(results) else 1


if __name__ == "__main__":
    sys.exit(main())
