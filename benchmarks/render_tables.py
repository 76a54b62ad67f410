"""Render the tables of README.md and docs/*.md from the records in benchmarks/results/.

A table in a Markdown file sits between two marker comments; the first names the table and the records it is
made from (WHERE and DATE of their file names, benchmarks/results/README.md):

    <!-- table:speed amd-epyc 2026-12-02 -->
    ... (rewritten by this script)
    <!-- /table -->

    python benchmarks/render_tables.py           # rewrite the tables in README.md and docs/*.md
    python benchmarks/render_tables.py --check   # exit 1, naming each table that differs, without writing

Tables: `speed` (inference and training-step ratios to the fastest of timm, Hugging Face and torchvision, the
range over the runs of one day), `speed-runs` (the same, run by run), `agreement` (int8 against fp32),
`recipes` (what each training recipe reached, in how long, where, and the split it chose on), `recipe-seeds`
(the test top-1 of runs that chose on a held-out part, mean ± sd over their seeds), `gpu` (ViT-B/16
against timm on a GPU), `serve` (vitkit serve against LitServe and mosec) and `runtimes` (optimize's models
against OpenVINO, ONNX Runtime and timm compiled, `vitkit bench --runtimes`) and `peak` (each engine's share
of the CPU's arithmetic peak, `benchmarks/bench_peak.py`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import RESULTS, ZEN5, Record, isa_suffix, records, run_command, seeds_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- table:(?P<args>[^>]*?) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)

# Inference cells, in table order, and the contenders of each column.
CELLS = (("ViT-B/16", 1), ("ViT-B/16", 16), ("ViT-S/16", 1), ("ViT-S/16", 16))
COLUMNS = (
    ("vitkit", "`accelerate(m)`"),
    ("vitkit-fp32-opt", '`optimize(m, "fp32")`'),
    ("vitkit-int8", '`optimize(m, "int8")`'),
)
TRAIN_ROWS = (  # (the training record's model, its row in a table)
    ("vit_small_patch16_224", "ViT-S/16"),
    ("recipe fashion-mnist", "fashion-mnist model"),
    ("recipe demo", "demo model"),
)


class TableError(ValueError):
    """A marker that names no table, or records that are missing."""


def load(rec: Record):
    return json.loads(rec.path.read_text())


def pick(recs: list[Record], what: str, where: str, date: str | None = None) -> list[Record]:
    found = [r for r in recs if r.what == what and r.where == where and (date is None or r.date == date)]
    if not found:
        raise TableError(f"no record {what}_{where}_{date or '*'}*.json in {RESULTS}")
    return found


def span(values: list[float], digits: int = 2) -> str:
    lo, hi = min(values), max(values)
    return (
        f"{lo:.{digits}f}x"
        if f"{lo:.{digits}f}" == f"{hi:.{digits}f}"
        else f"{lo:.{digits}f}-{hi:.{digits}f}x"
    )


def inference_ratios(recs: list[Record], where: str, date: str) -> list[dict[tuple[str, int, str], float]]:
    """Per run (tag), {(model, batch, contender): paired median ratio to the best anchor}."""
    runs: dict[str, dict] = {}
    for what in ("infer-b1", "infer-b16"):
        for rec in pick(recs, what, where, date):
            for row in load(rec)["rows"]:
                runs.setdefault(rec.tag, {})[(row["model"], row["batch"], row["contender"])] = row[
                    "vs_best_anchor"
                ]
    return [runs[t] for t in sorted(runs, key=lambda t: int(re.sub(r"\D", "", t) or 0))]


def training_ratios(recs: list[Record], where: str, date: str) -> list[dict[str, tuple[int, float]]]:
    """Per run, {model: (batch, ratio of vitkit's training step to timm's)}."""
    return [
        {c["model"]: (c["batch"], c["ratio_vitkit_over_timm"]) for c in load(rec)}
        for rec in pick(recs, "train-step", where, date)
    ]


def runs_line(m: dict, runs: int, command: str, date: str, where: str = "") -> str:
    """"CPU (features), N threads, torch V; R runs of `command` on DATE", from a record's `machine`; a Zen 5
    (WHERE with `-zen5`) is named so, as lscpu names it like a Zen 4."""
    has = [x for x, ok in (("VNNI", m.get("vnni")), ("native bf16", m.get("native_bf16"))) if ok]
    generation = " Zen 5" if ZEN5 in where else ""
    return (
        f"{m['cpu']}{generation} ({m.get('cpu_capability', '')}{', ' if has else ''}{', '.join(has)}), "
        f"{m['threads']} threads, torch {m['torch'].split('+')[0]}; {runs} run{'s' if runs != 1 else ''} of "
        f"`{command}` on {date}"
    )


def machine_line(recs: list[Record], where: str, date: str) -> str:
    found = pick(recs, "infer-b1", where, date)
    return runs_line(load(found[0])["machine"], len(found), "bash benchmarks/target_runs.sh", date, where)


def speed(recs: list[Record], where: str, date: str) -> str:
    inf, train = inference_ratios(recs, where, date), training_ratios(recs, where, date)
    caption = (
        machine_line(recs, where, date) + ". Each cell gives the range over the runs of the median "
        "per-round ratio to the fastest of timm, Hugging Face (sdpa) and torchvision. Training steps are "
        "compared with timm's. Higher is faster."
    )
    lines = [
        *textwrap.wrap(caption, 110, break_on_hyphens=False),
        "",
        "| model | " + " | ".join(c[1] for c in COLUMNS) + " |",
        "|---|" + "---:|" * len(COLUMNS),
    ]
    for model, batch in CELLS:
        cells = [span([run[(model, batch, c)] for run in inf]) for c, _ in COLUMNS]
        lines.append(f"| {model} inference, batch {batch} | " + " | ".join(cells) + " |")
    for key, label in TRAIN_ROWS:
        batch = train[0][key][0]
        cells = [span([run[key][1] for run in train])] + ["-"] * (len(COLUMNS) - 1)
        lines.append(f"| {label} training step, batch {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speed_runs(recs: list[Record], where: str, date: str) -> str:
    inf, train = inference_ratios(recs, where, date), training_ratios(recs, where, date)
    head = "| accelerate / fp32 / int8 | " + " | ".join(f"run {i}" for i in range(1, len(inf) + 1)) + " |"
    lines = [head, "|---|" + "---|" * len(inf)]
    for model, batch in CELLS:
        cells = [" / ".join(f"{run[(model, batch, c)]:.2f}" for c, _ in COLUMNS) for run in inf]
        lines.append(f"| {model} b{batch} | " + " | ".join(cells) + " |")
    for key, label in TRAIN_ROWS:
        lines.append(
            f"| training {label} b{train[0][key][0]} | "
            + " | ".join(f"{run[key][1]:.2f}" for run in train)
            + " |"
        )
    return "\n".join(lines)


def agreement(recs: list[Record], where: str, date: str, tag: str = "") -> str:
    """`int8-agreement` records of one day whose tag is `tag` (untagged by default: target_runs.sh's)."""
    lines = [
        "| checkpoint | images | top-1 fp32 | top-1 int8 | int8 agrees with fp32 | "
        "`optimize(fp32)` max abs diff |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for rec in pick(recs, "int8-agreement", where, date):
        if (rec.tag or "") != tag:
            continue
        d = load(rec)
        acc = d["accuracy"]
        lines.append(
            f"| `{d['checkpoint']}` (`make demo`) | {d['images']:,} | {100 * acc['fp32']:.2f} % | "
            f"{100 * acc['int8']:.2f} % | {100 * d['int8_top1_agreement_with_fp32']:.2f} % | "
            f"{d['fp32_opt_max_abs_diff']:.1e} |"
        )
    return "\n".join(lines)


def machine_name(d: dict, rec: Record) -> str:
    m = d.get("machine", {})
    if not m:
        return rec.where
    if "gpu" in m:
        return f"one {m['gpu']}"
    parts = [m.get("cpu", "?") + isa_suffix(rec.where), f"{m['cores']} cores" if "cores" in m else ""]
    return ", ".join(p for p in parts if p)


def minutes_of(d: dict) -> float:
    return d["train_minutes"] if "train_minutes" in d else d["seconds"] / 60


def chosen_on(d: dict) -> str:
    """The split a recipe record's run chose best/ (and any setting) on: its held-out part, or, for the
    records that predate it (no `val_split`), the test split."""
    return d.get("val_split", "test")


def recipes(recs: list[Record], *whats: str) -> str:
    """Every recipe record, one row each: the command that trains what its run trained under today's recipe
    (records.run_command), the test top-1 of the run's final model, and the split its best/ was chosen on."""
    lines = ["| recipe | command | test top-1 | chosen on | time | machine | date |",
             "|---|---|---:|---|---:|---|---|"]
    rows = [(r, load(r)) for r in recs if r.what.startswith("recipe-") and (not whats or r.what in whats)]
    for rec, d in sorted(rows, key=lambda rd: (rd[0].what, minutes_of(rd[1]))):
        top1 = d.get("test_top1", 100 * d.get("top1", 0.0))
        minutes = minutes_of(d)
        lines.append(
            f"| `{d['recipe']}` | `{run_command(d)}` | {top1:.2f} % | {chosen_on(d)} | {minutes:.1f} min | "
            f"{machine_name(d, rec)} | {rec.date} |"
        )
    return "\n".join(lines)


def recipe_seeds(recs: list[Record], *whats: str) -> str:
    """The recipe records of runs that chose on a held-out part, grouped by what they trained (the command
    that reproduces it, its folder and seed generalised: records.seeds_command) and machine: the test top-1 of
    the final model as mean and sample standard deviation over the seeds, the best held-out top-1 (mean), and
    the time (mean)."""
    groups: dict[tuple[str, str, str], list[tuple[Record, dict]]] = {}
    for rec in recs:
        if not rec.what.startswith("recipe-") or (whats and rec.what not in whats):
            continue
        d = load(rec)
        if "val_split" in d:
            key = (d["recipe"], seeds_command(d), machine_name(d, rec))
            groups.setdefault(key, []).append((rec, d))
    lines = ["| recipe | command | seeds S | test top-1, final model | best held-out top-1 | time | "
             "machine | date |", "|---|---|---|---:|---:|---:|---|---|"]
    for (recipe, command, machine), runs in sorted(groups.items()):
        tests = [d["test_top1"] for _, d in runs]
        vals = [d["best_val_top1"] for _, d in runs]
        minutes = statistics.mean(minutes_of(d) for _, d in runs)
        spread = f" ± {statistics.stdev(tests):.2f}" if len(tests) > 1 else ""
        seeds = ", ".join(str(s) for s in sorted(d.get("seed", 0) for _, d in runs))
        dates = ", ".join(sorted({rec.date for rec, _ in runs}))
        lines.append(f"| `{recipe}` | `{command}` | {seeds} | {statistics.mean(tests):.2f}{spread} % | "
                     f"{statistics.mean(vals):.2f} % | {minutes:.1f} min | {machine} | {dates} |")
    return "\n".join(lines)


def gpu(recs: list[Record], where: str, date: str) -> str:
    inf = load(pick(recs, "gpu-infer", where, date)[0])
    trains = [load(r) for r in pick(recs, "gpu-train", where, date)]
    m = inf["machine"]
    caption = (
        f"One {m['device']}, torch {m['torch'].split('+')[0]}, {date}, `python benchmarks/bench_gpu.py` "
        f"({inf['model']}). Ratios are to timm in bf16 (inference) and to timm's eager step (training)."
    )
    lines = [
        *textwrap.wrap(caption, 110, break_on_hyphens=False),
        "",
        f"| inference, batch {inf['inference']['batch']} | img/s | vs timm |",
        "|---|---:|---:|",
    ]
    for name, ips in inf["inference"]["images_per_s"].items():
        lines.append(f"| {name} | {ips:,.0f} | {inf['inference']['vs_reference'][name]:.2f}x |")
    runs = " | ".join(f"run {i}" for i in range(1, len(trains) + 1))
    lines += [
        "",
        f"| training step, batch {trains[0]['training']['batch']} | {runs} |",
        "|---|" + "---:|" * len(trains),
    ]
    for name in trains[0]["training"]["images_per_s"]:
        cells = [
            f"{t['training']['images_per_s'][name]:,.0f} img/s, {t['training']['vs_reference'][name]:.2f}x"
            for t in trains
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# `vitkit bench --runtimes`'s columns: (contender, heading); the vitkit ones also give their ratio to the
# faster runtime at their precision.
RUNTIME_COLUMNS = (
    ("timm", "timm eager"), ("timm-compiled", "timm compiled"),
    ("vitkit-fp32-opt", "vitkit fp32"), ("openvino-fp32", "OpenVINO fp32"), ("ort-fp32", "ORT fp32"),
    ("vitkit-int8", "vitkit int8"), ("openvino-int8", "OpenVINO int8"), ("ort-int8", "ORT int8"),
    ("vitkit-bf16", "vitkit bf16"), ("openvino-bf16", "OpenVINO bf16"),
)


def runtimes(recs: list[Record], where: str, date: str, tag: str = "") -> str:
    """`vitkit bench --runtimes` records of one day (those whose tag starts with `tag`, or with one of a
    comma-separated list: `run4,run5,run6`): each contender's images/s (median over the runs) per cell, and,
    for optimize's models, the range over the runs of the paired ratio to the faster runtime."""
    prefixes = tuple(tag.split(","))
    runs = [load(r) for r in pick(recs, "infer-runtimes", where, date) if (r.tag or "").startswith(prefixes)]
    if not runs:
        raise TableError(f"no record infer-runtimes_{where}_{date}_{tag}*.json in {RESULTS}")
    rows: dict[tuple[str, int, str], list[dict]] = {}
    for run in runs:
        for r in run["rows"]:
            rows.setdefault((r["model"], r["batch"], r["contender"]), []).append(r)
    columns = [(c, h) for c, h in RUNTIME_COLUMNS if any(k[2] == c for k in rows)]
    caption = (
        runs_line(runs[0]["machine"], len(runs), "vitkit bench --runtimes", date, where)
        + ". Images/s, the median over the runs; in brackets vitkit's "
        "paired ratio to the faster of OpenVINO and ONNX Runtime (ORT) at the same precision, the range over "
        "the runs. Higher is faster."
    )
    lines = [
        *textwrap.wrap(caption, 110, break_on_hyphens=False),
        "",
        "| model | " + " | ".join(h for _, h in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for model, batch in CELLS:
        if not any(k[:2] == (model, batch) for k in rows):
            continue
        cells = []
        for contender, _ in columns:
            found = rows.get((model, batch, contender), [])
            if not found:
                cells.append("-")
                continue
            text = f"{statistics.median(r['images_per_s'] for r in found):.1f}"
            ratios = [r["vs_best_runtime"] for r in found if r.get("vs_best_runtime") is not None]
            cells.append(text + (f" ({span(ratios)})" if ratios else ""))
        lines.append(f"| {model} b{batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The peak table's columns: (precision, contenders) and the target optimize's model has at that precision.
PEAK_COLUMNS = (("fp32", ("vitkit-fp32-opt", "openvino-fp32", "ort-fp32")),
                ("bf16", ("vitkit-bf16", "openvino-bf16")),
                ("int8", ("vitkit-int8", "openvino-int8", "ort-int8")))
SHORT = {"vitkit-fp32-opt": "vitkit", "vitkit-bf16": "vitkit", "vitkit-int8": "vitkit", "openvino-fp32": "OV",
         "openvino-bf16": "OV", "openvino-int8": "OV", "ort-fp32": "ORT", "ort-int8": "ORT"}


def peak_table(report: dict) -> str:
    """A `benchmarks/bench_peak.py` record: the peaks, the products alone, and per cell each contender's whole
    call as a share of its precision's peak (median over the records it read) beside the share optimize's
    target needs."""
    m, peaks = report["machine"], report["peaks"]
    products = {p: [r["gops"] / peaks[p]["gops"] for r in rows] for p, rows in report["products"].items()}
    caption = (
        f"{m['cpu']} ({m.get('cpu_capability', '')}), {report['threads']} threads, measured on "
        f"{report['date']} (`benchmarks/bench_peak.py`): peaks "
        + ", ".join(f"{p} {v['gops']:.0f} GOP/s ({v['kind']})" for p, v in peaks.items())
        + "; the layers `optimize` builds, alone at ViT-S/16's 197 rows: "
        + ", ".join(f"{p} {100 * min(v):.0f}-{100 * max(v):.0f} %" for p, v in products.items())
        + f" of the peak. Below, each whole call's rate as a share of its precision's peak (the records "
        f"{', '.join(report['records'])}, the median over them), and the share `optimize` would need for its "
        "target (1.05x the faster runtime at fp32, 1.1x at bf16 and int8), in bold."
    )
    cells: dict[tuple, list[dict]] = {}
    for r in report["cells"]:
        cells.setdefault((r["model"], r["batch"], r["contender"]), []).append(r)
    columns = [(p, cs) for p, cs in PEAK_COLUMNS if p in peaks and any(k[2] in cs for k in cells)]
    head = [h for p, cs in columns for h in [f"{p} {SHORT[c]}" for c in cs] + [f"{p} target needs"]]
    lines = [*textwrap.wrap(caption, 110, break_on_hyphens=False), "",
             "| cell | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for model, batch in CELLS:
        row = []
        for _, contenders in columns:
            for c in contenders:
                found = cells.get((model, batch, c), [])
                row.append(f"{100 * statistics.median(r['of_peak'] for r in found):.0f} %" if found else "-")
            need = [r["target_of_peak"] for r in cells.get((model, batch, contenders[0]), [])
                    if "target_of_peak" in r]
            row.append(f"**{100 * statistics.median(need):.0f} %**" if need else "-")
        if any(x != "-" for x in row):
            lines.append(f"| {model} b{batch} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def peak(recs: list[Record], where: str, date: str, tag: str | None = None) -> str:
    """The `peak` record of one day: peak_WHERE_DATE_TAG.json where a tag is given, else the day's last."""
    found = sorted(pick(recs, "peak", where, date), key=lambda r: r.path.name)
    if tag is not None:
        found = [r for r in found if r.tag == tag]
        if not found:
            raise TableError(f"no record peak_{where}_{date}_{tag}.json in {RESULTS}")
    return peak_table(load(found[-1]))


# benchmarks/bench_serve.py's servers (vitkit serve first, then the anchors) and client counts.
SERVERS = ("vitkit", "litserve", "mosec")
SERVE_CONCURRENCY = (1, 4, 16, 64)


def serve_table(result: dict) -> str:
    """A bench_serve record's cells: each server's requests/s (p50 / p99 ms, server CPU ms per request) and
    vitkit serve's over the best anchor's."""
    lines = ["| model | clients | vitkit serve req/s (p50 / p99 ms, CPU ms/req) | LitServe | mosec | "
             "vitkit / best anchor |", "|---|---:|---|---|---|---:|"]
    for name, entry in result["models"].items():
        cells = {(c["server"], c["clients"]): c for c in entry["cells"]}
        by_clients = {r["clients"]: r for r in entry["ratios"]}
        for clients in SERVE_CONCURRENCY:
            row = [name, str(clients)]
            for server in SERVERS:
                c = cells.get((server, clients))
                row.append("-" if c is None else
                           f"{c['req_s']:.1f} ({c['p50_ms']:.0f} / {c['p99_ms']:.0f}, "
                           f"{c['server_cpu_ms_per_request']:.1f})"
                           + (f" {c['errors']} errors" if c["errors"] else ""))
            r = by_clients.get(clients)
            row.append("-" if r is None else f"{r['vitkit_over_best']:.2f}x")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def serve(recs: list[Record], where: str, date: str, tag: str = "") -> str:
    """The serving table of the record serve_WHERE_DATE[_TAG].json."""
    found = [r for r in pick(recs, "serve", where, date) if r.tag == tag]
    if not found:
        raise TableError(f"no record serve_{where}_{date}{'_' + tag if tag else ''}.json in {RESULTS}")
    d = load(found[0])
    v = d["versions"]
    rounds = max(c["rounds"] for entry in d["models"].values() for c in entry["cells"])
    caption = (
        f"{d['cpu']}, {d['cores']} cores, {date}, {rounds} rounds (medians); "
        f"every server {processes(d.get('processes', 1))}on {d['threads']} PyTorch "
        f"thread{'s' if d['threads'] != 1 else ''}{' each' if d.get('processes', 1) > 1 else ''}; vitkit "
        f"{v['vitkit']} (uvicorn {v['uvicorn']}), LitServe {v['litserve']}, mosec {v['mosec']}, torch "
        f"{v['torch'].split('+')[0]}; `python {d['command']}`"
    )
    return "\n".join([*textwrap.wrap(caption, 110, break_on_hyphens=False), "", serve_table(d)])


def processes(n: int) -> str:
    """How a serving record's servers were spread over processes, for its caption."""
    if n == 1:
        return ""
    return (f"in {n} processes (vitkit serve --workers {n}; LitServe {n} API servers and {n} model workers; "
            f"mosec {n} processes a stage) ")


TABLES: dict[str, Callable[..., str]] = {
    "speed": speed,
    "speed-runs": speed_runs,
    "agreement": agreement,
    "recipes": recipes,
    "recipe-seeds": recipe_seeds,
    "gpu": gpu,
    "serve": serve,
    "runtimes": runtimes,
    "peak": peak,
}


def render_block(args: str, recs: list[Record]) -> str:
    name, *params = args.split()
    if name not in TABLES:
        raise TableError(f"no table {name!r}; tables: {', '.join(TABLES)}")
    return TABLES[name](recs, *params)


def render_text(text: str, recs: list[Record]) -> str:
    """`text` with every table between markers rendered anew."""
    return BLOCK.sub(lambda m: m[1] + render_block(m["args"], recs) + "\n" + m[4], text)


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if a table differs")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the records' folder")
    parser.add_argument("files", nargs="*", type=Path, help="Markdown files (default: README.md, docs/*.md)")
    args = parser.parse_args(argv)
    recs = records(args.results)
    stale = []
    for path in args.files or documents():
        text = path.read_text()
        try:
            new = render_text(text, recs)
        except TableError as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 2
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    for path in stale:
        print(f"{path}: {'tables differ from the records' if args.check else 'tables rewritten'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
