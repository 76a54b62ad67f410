"""The data-scaling study of the paper's Fig. 3 at Fashion-MNIST scale: a small ViT, a BiT ResNet and the
hybrid trained from scratch on class-balanced subsets of 1k, 3k, 10k, 30k and 60k images, and the ablations
of the position embedding (Table 8) and of the class token against GAP (Appendix D.3). The models, the
training and the measurements are in benchmarks/study_cells.py.

Budget: the same number of optimizer steps (STEPS of 128 images) for every model and every size, so each
cell costs about the same compute and the models differ only in what they make of the data: a small set is
revisited for many epochs, the full set seen about once. Equal epochs instead would give the 1k cells a
sixtieth of the 60k cells' compute, and a gap between sizes would mix data with compute. STEPS is sized so
that the whole study (SIZES x MODELS x seeds, two seeds up to 10k, and the ablations' 3 seeds) fits about
4 hours on 2 cores of an AVX2-only CPU, about 1 hour where the CPU computes bf16 natively.

    python benchmarks/study_data_scaling.py                      # the study, resumable cell by cell
    python benchmarks/study_data_scaling.py --cells 'vit_n1000*' # only the cells whose key matches
    python benchmarks/study_data_scaling.py --ablations          # Table 8 and D.3 at 60k, 3 seeds
    python benchmarks/study_data_scaling.py --report             # table and figure from the records
    python benchmarks/study_data_scaling.py --tiny --out /tmp/s  # the tiny twin: seconds
    python benchmarks/study_data_scaling.py --device cuda --seeds 5 --time-limit 300   # on a GPU

On a GPU (`--device cuda`) the cells are the same, built on the CPU from their seed and moved; `--seeds N`
gives every size (and the ablations) N seeds, seed by seed; benchmarks/gpu_check.sh runs it so.

Every finished cell writes `<out>/<cell key>.json` atomically; a cell whose record exists is skipped, so a
killed study restarts where it stopped (the killed cell starts again from scratch: about 1.5 minutes).
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import RESULTS, cpu_model, slug  # noqa: E402
from study_cells import MODELS, VARIANTS, Cell, StudyData, run_cell  # noqa: E402

SIZES = (1000, 3000, 10000, 30000, 60000)
TWO_SEEDS_UP_TO = 10000
STEPS = 400
ABLATION_SIZE = 60000
ABLATION_SEEDS = (0, 1, 2)
TINY_SIZES = (100, 200)
TINY_STEPS = 3
TINY_BATCH = 16
TINY_TEST = 200
VARIANT_NAMES = {"": "learned 1D, class token", "pos-none": "none, class token",
                 "pos-2d": "learned 2D (row, column halves), class token",
                 "pos-sincos": "2D sin-cos (fixed), class token", "gap": "learned 1D, GAP (same lr)",
                 "gap-lr3": "learned 1D, GAP (lr / 3)"}
# The paper's Table 8: ViT-B/16, 5-shot ImageNet linear accuracy after JFT pre-training. D.3 (Fig. 9)
# compares the class token and GAP in curves, not one number.
PAPER_TABLE8 = {"pos-none": 0.614, "": 0.642, "pos-2d": 0.640}
PAPER_RELATIVE = 0.640  # relative position embedding, which vitkit does not have


def study_cells(tiny: bool = False, seeds: int | None = None) -> list[Cell]:
    """The study's cells in the order they run: seed by seed, smaller sets first, every model at a size
    before the next size. `seeds`: that many seeds at every size (where compute is plentiful, as on a GPU);
    by default two seeds up to TWO_SEEDS_UP_TO images and one above (one for the tiny twin)."""
    if tiny:
        return [Cell(m, n, s, TINY_STEPS, TINY_BATCH, tiny=True) for s in range(seeds or 1)
                for n in TINY_SIZES for m in MODELS]
    if seeds is None:
        return [Cell(m, n, s, STEPS) for s in (0, 1) for n in SIZES if s == 0 or n <= TWO_SEEDS_UP_TO
                for m in MODELS]
    return [Cell(m, n, s, STEPS) for s in range(seeds) for n in SIZES for m in MODELS]


def ablation_cells(tiny: bool = False, seeds: int | None = None) -> list[Cell]:
    """The ViT's variants (VARIANTS) at ABLATION_SIZE, seed by seed (ABLATION_SEEDS, or `seeds` of them);
    the default variant's cells are the study's own ViT cells at that size."""
    seed_list = range(seeds) if seeds is not None else (0,) if tiny else ABLATION_SEEDS
    if tiny:
        return [Cell("vit", TINY_SIZES[-1], s, TINY_STEPS, TINY_BATCH, variant=v, tiny=True)
                for s in seed_list for v in VARIANTS]
    return [Cell("vit", ABLATION_SIZE, s, STEPS, variant=v) for s in seed_list for v in VARIANTS]


def record_file(out: Path, cell: Cell) -> Path:
    return out / f"{cell.key}.json"


def write_atomically(path: Path, data: dict) -> None:
    """Write JSON to a temporary file beside `path`, then rename it over: a killed run leaves no half
    record."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def machine(device: torch.device) -> dict:
    from vitkit.cpu.hardware import cpu_has_native_bf16

    info = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "native_bf16": cpu_has_native_bf16(),
            "torch": torch.__version__, "device": device.type}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def resolve_device(name: str) -> torch.device:
    """`cpu`, `cuda[:N]`, or `auto` (the GPU where there is one); a GPU that is not there is a ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r}: not a device ({e})") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: the study runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name!r}: this PyTorch sees no CUDA GPU")
    return device


def run_cells(cells: list[Cell], out: Path, data_loader, stop_at: float | None = None,
              log_every: int = 0, device: torch.device = torch.device("cpu")) -> list[str]:
    """Run every cell without a record in `out`, one at a time, on `device`; returns the keys run.
    `stop_at`: a time (time.time()) after which no new cell starts."""
    out.mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if not record_file(out, c).exists()]
    print(f"{len(cells) - len(todo)} of {len(cells)} cells recorded in {out}; {len(todo)} to run", flush=True)
    ran, data = [], None
    for cell in todo:
        if stop_at is not None and time.time() >= stop_at:
            print(f"stopping before {cell.key}: past --stop-at or --time-limit", flush=True)
            break
        data = data or data_loader()
        result = run_cell(cell, data, log_every, device)
        record = {"cell": cell.to_dict(), "key": cell.key, **result, "machine": machine(device),
                  "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                  "measured_with": "python benchmarks/study_data_scaling.py"
                  + (" --tiny" if cell.tiny else "") + (" --ablations" if cell.variant else "")
                  + (f" --device {device.type}" if device.type != "cpu" else "")}
        write_atomically(record_file(out, cell), record)
        print(f"{cell.key}: top-1 {result['test_top1']:.4f}, 10-shot {result['fewshot']['10']['mean']:.4f}, "
              f"{result['train_seconds']:.0f} s + {result['eval_seconds']:.0f} s", flush=True)
        ran.append(cell.key)
    return ran


def read_records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def _stats(values: list[float]) -> str:
    """`mean ± std (n)` in percent; the std is over seeds (population), absent for one seed."""
    if not values:
        return "to run"
    m = 100 * float(np.mean(values))
    if len(values) == 1:
        return f"{m:.1f} (1)"
    return f"{m:.1f} ± {100 * float(np.std(values)):.1f} ({len(values)})"


def group(records: list[dict], cells: list[Cell]) -> dict[tuple[str, str, int], list[dict]]:
    """The records of `cells`, by (model, variant, train size)."""
    keys = {c.key for c in cells}
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for c in cells:
        groups.setdefault((c.model, c.variant, c.train_size), [])
    for r in records:
        if r["key"] in keys:
            c = r["cell"]
            groups[(c["model"], c["variant"], c["train_size"])].append(r)
    return groups


def scaling_table(records: list[dict], cells: list[Cell]) -> str:
    """Markdown: one row per training-set size, top-1 and 10-shot of each model (mean ± std over seeds,
    the seed count in brackets, in percent)."""
    g = group(records, cells)
    sizes = sorted({c.train_size for c in cells})
    head = "| images | " + " | ".join(f"{m} top-1 | {m} 10-shot" for m in MODELS) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(MODELS))]
    for n in sizes:
        cols = []
        for m in MODELS:
            rs = g.get((m, "", n), [])
            cols += [_stats([r["test_top1"] for r in rs]), _stats([r["fewshot"]["10"]["mean"] for r in rs])]
        lines.append(f"| {n:,} | " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n"


def ablation_table(records: list[dict], cells: list[Cell]) -> str:
    """Markdown: one row per ViT variant: top-1, 5-shot, 10-shot (mean ± std over seeds) and the paper's
    Table 8 5-shot number beside."""
    g = group(records, cells)
    lines = ["| position embedding, pooling | top-1 | 5-shot | 10-shot | paper (Table 8, 5-shot) |",
             "|---|---|---|---|---|"]
    for v in VARIANTS:
        rs = next((rs for (m, var, _), rs in g.items() if var == v), [])
        paper = f"{100 * PAPER_TABLE8[v]:.1f}" if v in PAPER_TABLE8 else "—"
        lines.append(f"| {VARIANT_NAMES[v]} | {_stats([r['test_top1'] for r in rs])} | "
                     f"{_stats([r['fewshot']['5']['mean'] for r in rs])} | "
                     f"{_stats([r['fewshot']['10']['mean'] for r in rs])} | {paper} |")
    return "\n".join(lines) + "\n"


def scaling_figure(records: list[dict], cells: list[Cell], path: Path) -> Path:
    """Test top-1 (left) and 10-shot (right) against training-set size, one line per model, the mean over
    seeds with the range of the seeds as error bars (as the paper's Fig. 3 in form)."""
    import matplotlib.pyplot as plt

    from vitkit.analysis.figures import save_figure

    g = group(records, cells)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, what in zip(axes, ("test top-1", "10-shot linear"), strict=True):
        for m in MODELS:
            pts = []
            for (model, variant, n), rs in sorted(g.items(), key=lambda kv: kv[0][2]):
                if model == m and variant == "" and rs:
                    v = [100 * (r["test_top1"] if what == "test top-1" else r["fewshot"]["10"]["mean"])
                         for r in rs]
                    pts.append((n, np.mean(v), np.mean(v) - min(v), max(v) - np.mean(v)))
            if pts:
                n, mean, lo, hi = map(np.array, zip(*pts, strict=True))
                ax.errorbar(n, mean, yerr=[lo, hi], marker="o", capsize=3, label=m)
        ax.set_xscale("log")
        ax.set_xlabel("training images (class-balanced Fashion-MNIST subset)")
        ax.set_ylabel(f"{what} accuracy (%)")
        ax.set_title(f"{what} on the 10,000 test images")
        ax.grid(alpha=0.3)
        ax.legend()
    return save_figure(fig, path)


def missing(records: list[dict], cells: list[Cell]) -> list[str]:
    done = {r["key"] for r in records}
    return [c.key for c in cells if c.key not in done]


def report(out: Path, tiny: bool, table: Path, figure: Path, seeds: int | None = None) -> str:
    """Render the tables (markdown, also written to `table`) and the figure from the records in `out`, over
    the cells of `study_cells(tiny, seeds)` and `ablation_cells(tiny, seeds)`."""
    records = read_records(out)
    cells, ablations = study_cells(tiny, seeds), ablation_cells(tiny, seeds)
    todo = missing(records, cells)
    todo_ab = missing(records, ablations)
    text = ("### Data scaling\n\n" + scaling_table(records, cells)
            + f"\n{len(cells) - len(todo)} of {len(cells)} cells recorded"
            + (f"; still to run: {', '.join(todo)}" if todo else "") + ".\n"
            + "\n### Ablations\n\n" + ablation_table(records, ablations)
            + f"\n{len(ablations) - len(todo_ab)} of {len(ablations)} cells recorded"
            + (f"; still to run: {', '.join(todo_ab)}" if todo_ab else "") + ".\n")
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text(text)
    scaling_figure(records, cells, figure)
    return text


def default_out(tiny: bool, device: torch.device = torch.device("cpu")) -> Path:
    """benchmarks/results/study-data-scaling[-tiny]_<cpu or gpu>: records of different machines apart."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return RESULTS / f"study-data-scaling{'-tiny' if tiny else ''}_{slug(where)}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="records folder (default benchmarks/results/"
                   "study-data-scaling_<cpu or gpu>)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, or auto (the GPU if any)")
    p.add_argument("--seeds", type=int, help="train every size with this many seeds (default: 2 seeds up to "
                   f"{TWO_SEEDS_UP_TO:,} images and 1 above; the ablations {len(ABLATION_SEEDS)})")
    p.add_argument("--tiny", action="store_true", help="the tiny twin: tiny models, 3 steps, 2 sizes")
    p.add_argument("--cells", default="*", help="run only the cells whose key matches this glob")
    p.add_argument("--ablations", action="store_true", help="run the ablation cells instead of the study's")
    p.add_argument("--report", action="store_true", help="render the tables and the figure, run nothing")
    p.add_argument("--table", type=Path, help="markdown file of --report (default <out>/table.md)")
    p.add_argument("--figure", type=Path, help="PNG of --report (default <out>/figure.png)")
    p.add_argument("--stop-at", help="start no new cell after this UTC time, HH:MM")
    p.add_argument("--time-limit", type=float, help="start no new cell after this many seconds")
    p.add_argument("--log-every", type=int, default=0, help="print the loss every N steps (0: never)")
    p.add_argument("--list", action="store_true", help="print the cells' keys and whether each is recorded")
    args = p.parse_args(argv)
    if args.seeds is not None and args.seeds < 1:
        p.error(f"--seeds {args.seeds}: need at least 1")
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        p.error(str(e))
    out = args.out or default_out(args.tiny, device)
    if args.report:
        print(report(out, args.tiny, args.table or out / "table.md", args.figure or out / "figure.png",
                     args.seeds))
        return 0
    cells = ablation_cells(args.tiny, args.seeds) if args.ablations else study_cells(args.tiny, args.seeds)
    cells = [c for c in cells if fnmatch.fnmatch(c.key, args.cells)]
    if not cells:
        p.error(f"--cells {args.cells!r} matches no cell; --list shows their keys")
    if args.list:
        for c in cells:
            print(c.key, "recorded" if record_file(out, c).exists() else "to run")
        return 0
    stop_at = None
    if args.stop_at:
        now = datetime.datetime.now(datetime.timezone.utc)
        h, m = (int(x) for x in args.stop_at.split(":"))
        stop_at = now.replace(hour=h, minute=m, second=0, microsecond=0).timestamp()
    if args.time_limit is not None:
        stop_at = min(stop_at or math.inf, time.time() + args.time_limit)
    loader = (lambda: StudyData.load(TINY_TEST)) if args.tiny else StudyData.load
    run_cells(cells, out, loader, stop_at, args.log_every, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
