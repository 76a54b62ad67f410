r"""The Fashion-MNIST benchmark: the `fashion-mnist` recipe (a pure ViT, no convolution beyond the patch
projection) trained from scratch on the CPU, its test accuracy and its wall time, next to the anchors of the
dataset's README. The target: 93.0 % or better within 30 minutes on 2 CPU cores; the goal 94.5 %.

The run trains on 55,000 training images and validates on the 5,000 it holds out (the recipe's
`data.holdout`, the same for every seed), which choose best/; the test split is evaluated once, at the end,
with the final weights: the record's `test_top1`. Run it with several seeds (`--set seed=N --record seedN`)
for the mean and spread that `benchmarks/render_tables.py` renders.

    .venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/fashion_mnist.py --out runs/bench-fmnist
    .venv/bin/python benchmarks/fashion_mnist.py --out runs/x            # one process (slower on 2 cores)
    .venv/bin/python benchmarks/fashion_mnist.py --recipe demo --out runs/bench-demo
    .venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/fashion_mnist.py --out runs/x \
        --set epochs=100
    .venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/fashion_mnist.py --out runs/x --record seed0

The recipe's figures are for two processes of one thread each (torchrun sets one thread per process). The run
is an ordinary `vitkit train` run (resumable with --resume); the held-out part is evaluated every few epochs
(the recipe's `eval_every`), so the report also gives the time at which each accuracy level was first reached
on it (from RUN/metrics.csv); `wall_minutes` counts from the first process's start. The report's `config` is
the run's resolved config (RUN/config.json), from which `benchmarks/render_tables.py` renders the command that
trains the same under today's recipe.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import cpu_model, record_path, slug  # noqa: E402

# Test accuracy (%) from the README of zalandoresearch/fashion-mnist.
ANCHORS = {"MLP 256-128-64": 90.0, "two-layer CNN (<100k parameters)": 92.5, "WRN-40-4": 96.7}
LEVELS = (85.0, 90.0, 92.0, 93.0, 94.0, 94.5)


def time_to_levels(metrics_csv: Path, start: float) -> dict[float, float | None]:
    """Seconds from `start` (a time.time()) to the first evaluation at or above each accuracy level."""
    with metrics_csv.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["split"] == "val" and r["top1"]]
    reached: dict[float, float | None] = dict.fromkeys(LEVELS)
    for r in rows:
        for level in LEVELS:
            if reached[level] is None and 100 * float(r["top1"]) >= level:
                reached[level] = float(r["time"]) - start
    return reached


def fp32_test_top1(model_dir: Path, cfg) -> float:
    """Top-1 (%) on the run's test split of the saved model evaluated in fp32, as `vitkit eval` does: the
    figure a user gets from the checkpoint, whatever precision the training (and its evaluations) ran in."""
    from vitkit import load
    from vitkit.train.evaluate import evaluate
    from vitkit.train.prepare import load_data

    model = load(model_dir)
    test = load_data(cfg).test
    return 100 * evaluate(model, test, model.cfg, cfg.data.eval_batch_size, "cpu").top1


def training_gpu(device: str) -> str | None:
    """The GPU a run on `device` ('auto', 'cuda', 'cuda:N', ...) trains on, by name; None on a CPU."""
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return torch.cuda.get_device_name(torch.device("cuda" if device == "auto" else device))
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="fashion-mnist")
    parser.add_argument("--out", required=True, type=Path, help="run folder")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--record", metavar="TAG", nargs="?", const="",
                        help="also write the report to benchmarks/results/recipe-RECIPE_CPU_DATE[_TAG].json")
    args = parser.parse_args()

    from vitkit.bench import write_json
    from vitkit.counting import count_parameters
    from vitkit.train import get_recipe, train

    cfg = get_recipe(args.recipe, args.overrides)
    start = time.time()  # wall time includes loading the data and building the model
    result = train(cfg, args.out, resume=args.resume)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, the first process reports
        return
    if result.test is None or result.final is None:
        raise SystemExit("the run has no held-out part or no test split (data.val_split, data.test_split)")
    wall_minutes = (time.time() - start) / 60
    reached = time_to_levels(args.out / "metrics.csv", start)  # (from this process's start when resumed)
    fp32 = fp32_test_top1(result.last_dir, cfg)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    gpu = training_gpu(cfg.device)
    sets = "".join(f" --set {o}" for o in args.overrides)
    report = {
        "command": f"vitkit train {args.recipe} --out {args.out}"
        + (f" --nproc {processes}" if processes > 1 else "") + sets,
        "measured_with": " ".join(["python", *sys.argv]),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "processes": processes,
                    "threads": torch.get_num_threads(), **({"gpu": gpu} if gpu else {})},
        "recipe": args.recipe,
        "overrides": args.overrides,
        "precision": cfg.precision,
        "seed": cfg.seed,
        "val_split": result.split,  # what chose best/ and what the accuracy levels below were read on
        "val_images": result.final.count,
        "test_split": result.test_split,  # evaluated once, at the end, with the final weights
        "test_images": result.test.count,
        "test_top1": 100 * result.test.top1,
        "test_top1_saved_fp32": fp32,
        "val_top1": 100 * result.final.top1,
        "best_val_top1": 100 * (result.best_top1 or 0.0),
        "train_minutes": result.seconds / 60,
        "wall_minutes": wall_minutes,
        "steps": result.steps,
        "parameters": count_parameters(result_cfg := cfg.model.replace(num_classes=10)),
        "tokens": result_cfg.num_tokens,
        "minutes_to_accuracy": {f"{k:.1f}": (None if v is None else round(v / 60, 2))
                                for k, v in reached.items()},
        # what the run trained, as train() resolved and wrote it (TrainConfig.to_json): the typed command
        # names a recipe, whose defaults change
        "config": json.loads((args.out / "config.json").read_text()),
    }
    write_json(report, args.out / "benchmark.json")
    if args.record is not None:
        record = record_path(f"recipe-{args.recipe}", where=slug(gpu) if gpu else None,
                             tag=args.record or None)
        write_json(report, record)
        print(f"record: {record}")
    print(f"\n{args.recipe}: test top-1 {report['test_top1']:.2f} % (final weights; {result.split} top-1 "
          f"{report['val_top1']:.2f} %, best {report['best_val_top1']:.2f} %) after "
          f"{report['train_minutes']:.1f} min, {result.steps} steps, {report['parameters']:,} parameters")
    print(f"  the saved model evaluated in fp32: {fp32:.2f} % (training precision: {cfg.precision})")
    for level, minutes in report["minutes_to_accuracy"].items():
        print(f"  {level} % reached on the {result.split} part after "
              + (f"{minutes:.1f} min" if minutes is not None else "-"))
    print("anchors (dataset README): " + ", ".join(f"{k} {v} %" for k, v in ANCHORS.items()))
    print(f"run folder: {args.out}   report: {args.out / 'benchmark.json'}")


if __name__ == "__main__":
    main()
