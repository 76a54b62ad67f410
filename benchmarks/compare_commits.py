"""Two commits of vitkit against each other, in one interleaved run, on the command line's default paths.

Each commit is checked out into a temporary git worktree and imported by a worker process of its own; the
parent asks the two workers in turn, in a fresh random order each round, to time one call, so that both see
the same machine state. Only one worker computes at a time. The cells:

- the training step (forward, loss, backward, the trainer's AdamW) of the `fashion-mnist` and `demo` recipes'
  models at their batch sizes and precision (bf16 autocast where the recipe asks for it and the CPU has native
  bf16), and of ViT-S/16 at batch 8; the model as `vitkit train` runs it (through `vitkit.accelerate` where
  the commit has it);
- inference of ViT-S/16 and ViT-B/16 at batch 1 and 16 through `vitkit.optimize(model, "fp32")` and "int8",
  as `vitkit eval` and `vitkit predict` run it.

The ratio of a cell is paired: the median over rounds of the old commit's time over the new one's (above 1:
the new commit is faster). Run:

    .venv/bin/python benchmarks/compare_commits.py OLD NEW --threads 2 \
        --json benchmarks/results/compare_CPU_DATE.json

NEW may be `WORKTREE` (the working tree as it is). --quick times three cells for a smoke test; `--cell int8`
only the cells whose label has every word given (`--cell "infer ViT-S/16 1"`), and may be repeated.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN_CELLS = [("train", "fashion-mnist", 0), ("train", "demo", 0), ("train", "ViT-S/16", 8)]
INFER_CELLS = [("infer", f"ViT-{size}/16", batch, precision) for size in ("S", "B")
               for precision in ("fp32", "int8") for batch in (1, 16)]


# --- the worker: one commit's vitkit, imported from PYTHONPATH ----------------------------------------------
def _native_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & set(_cpuinfo("flags").split()))


def _cpuinfo(field: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field)), "")
    except OSError:
        return ""


def _training_call(name: str, batch: int):
    import contextlib

    import torch
    import torch.nn.functional as F

    import vitkit
    from vitkit.train.optim import build_optimizer
    from vitkit.train.recipes import get_recipe

    if name.startswith("ViT-"):
        cfg, optim, precision = (vitkit.get_config(name, num_classes=1000), type(get_recipe("demo").optim)(),
                                 "auto")
    else:
        recipe = get_recipe(name)
        cfg, optim, precision, batch = recipe.model, recipe.optim, recipe.precision, recipe.batch_size
    torch.manual_seed(0)
    model = vitkit.create_model(cfg).train()
    if hasattr(vitkit, "accelerate"):
        vitkit.accelerate(model)
    opt = build_optimizer(model, optim)
    x, y = torch.randn(batch, cfg.in_chans, *cfg.image_size), torch.randint(0, cfg.num_classes, (batch,))
    amp = precision == "bf16-native" and _native_bf16()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext():
            logits = model(x)
        F.cross_entropy(logits.float(), y).backward()
        opt.step()

    return step


def _inference_call(name: str, batch: int, precision: str):
    import torch

    import vitkit

    torch.manual_seed(0)
    model = vitkit.create_model(name, num_classes=1000).eval()
    with torch.no_grad():
        model.head.weight.normal_(std=0.02)
    fast = vitkit.optimize(model, precision)
    x = torch.randn(batch, 3, 224, 224)

    def call() -> None:
        with torch.inference_mode():
            fast(x)

    return call


def worker(threads: int) -> None:
    """Read commands from stdin ("build JSON", "run", "drop"), answer on stdout."""
    import torch

    import vitkit

    if threads:
        torch.set_num_threads(threads)
    vitkit.retain_freed_memory()
    call = None
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "build":
            cell = json.loads(arg)
            call = _training_call(*cell[1:]) if cell[0] == "train" else _inference_call(*cell[1:])
            answer = "ok"
        elif command == "run":
            t = time.perf_counter()
            call()
            answer = f"{time.perf_counter() - t:.9f}"
        elif command == "drop":
            call = None
            answer = "ok"
        else:
            answer = f"error unknown command {command!r}"
        print(answer, flush=True)


# --- the parent ---------------------------------------------------------------------------------------------
class Worker:
    def __init__(self, tree: Path, threads: int):
        env = {**os.environ, "PYTHONPATH": str(tree / "src")}
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=tree)

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if not answer or answer.startswith("error"):
            raise RuntimeError(f"worker failed on {line!r}: {answer or 'no answer (see its stderr above)'}")
        return answer

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def checkout(rev: str, where: Path) -> Path:
    if rev == "WORKTREE":
        return REPO
    sha = subprocess.check_output(["git", "-C", str(REPO), "rev-parse", rev], text=True).strip()
    tree = where / sha[:12]
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), sha], check=True)
    return tree


def cell_label(cell: tuple) -> str:
    """A cell as the table prints it: "train demo", "infer ViT-S/16 16 int8"."""
    return " ".join(str(c) for c in cell if c != 0)


def matches(cell: tuple, words: str) -> bool:
    """Whether every word of `words` is a word of the cell's label."""
    return set(words.split()) <= set(cell_label(cell).split())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", nargs="?", help="the commit to compare against (e.g. a tag or a hash)")
    p.add_argument("new", nargs="?", default="WORKTREE",
                   help="the commit to measure (default: the working tree)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads of each worker (0: torch's default)")
    p.add_argument("--repeats", type=int, default=8, help="interleaved rounds per cell")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls of each commit first")
    p.add_argument("--quick", action="store_true", help="three cells, three rounds: a smoke test")
    p.add_argument("--cell", action="append", default=[], metavar="WORDS",
                   help="only the cells whose label holds every word of WORDS (e.g. 'int8', 'infer ViT-S/16 "
                        "16'); may be given more than once")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.threads)
    if not args.old:
        p.error("name the OLD commit")
    cells = TRAIN_CELLS + INFER_CELLS
    repeats = args.repeats
    if args.quick:
        cells, repeats = [TRAIN_CELLS[1], INFER_CELLS[0], INFER_CELLS[2]], 3
    if args.cell:
        cells = [c for c in cells if any(matches(c, words) for words in args.cell)]
        if not cells:
            p.error(f"no cell matches {args.cell}; the cells: "
                    + "; ".join(cell_label(c) for c in TRAIN_CELLS + INFER_CELLS))
    rng = random.Random(0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="vitkit-compare-") as tmp:
        trees = {"old": checkout(args.old, Path(tmp)), "new": checkout(args.new, Path(tmp))}
        workers = {k: Worker(tree, args.threads) for k, tree in trees.items()}
        try:
            for cell in cells:
                for w in workers.values():
                    w.ask("build " + json.dumps(cell))
                    for _ in range(args.warmup):
                        w.ask("run")
                times: dict[str, list[float]] = {k: [] for k in workers}
                for _ in range(repeats):
                    order = list(workers)
                    rng.shuffle(order)
                    for k in order:
                        times[k].append(float(workers[k].ask("run")))
                for w in workers.values():
                    w.ask("drop")
                ratio = statistics.median(o / n for o, n in zip(times["old"], times["new"], strict=True))
                label = cell_label(cell)
                rows.append({"cell": label, "old_ms": 1e3 * statistics.median(times["old"]),
                             "new_ms": 1e3 * statistics.median(times["new"]), "old_over_new": ratio})
                print(f"{label:28s} old {rows[-1]['old_ms']:9.2f} ms  new {rows[-1]['new_ms']:9.2f} ms  "
                      f"{ratio:.3f}x", flush=True)
        finally:
            for w in workers.values():
                w.close()
            for tree in trees.values():
                if tree != REPO:
                    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                                   check=False)
    if args.json:
        cpu = _cpuinfo("model name")
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"old": args.old, "new": args.new, "cpu": cpu,
                                               "threads": args.threads,
                                               "repeats": repeats, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
