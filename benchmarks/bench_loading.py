"""Loading a checkpoint: `vitkit.load` against timm's and transformers' own loaders, on the same weights.

For each model the script writes one random-weight model three ways (a vitkit folder; timm's hub layout, a
`model.safetensors` with its config; a transformers folder, by vitkit's converters), then loads them in fresh
processes, rounds interleaved: vitkit.load of each, `timm.create_model(..., pretrained=True,
pretrained_cfg_overlay={"file": ...})` of timm's file, and `ViTForImageClassification.from_pretrained` of the
transformers folder. Each process imports its library and loads a small model first (so that the figure is
the loading, not the imports), then times the load and reads its peak resident memory (VmHWM) above its
resident memory just before. transformers maps the file and reads a weight only when it is first used, so
each process then reads one value of every page of every weight (the least a first forward does) and the
figures are given both at the load's return and once the weights are read ("ready"). The files are read from
the page cache (written just before). Medians over the rounds; the file size beside them.

    python benchmarks/bench_loading.py --json $(python benchmarks/records.py name loading)
    python benchmarks/bench_loading.py --models ViT-B/16 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from records import write_rows

MODELS = ("ViT-B/16", "ViT-H/14")
MIB = 2**20


def status_mib(field: str) -> float:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def worker(loader: str, path: str, small: str, timm_name: str) -> dict:
    """One load in this (fresh) process: its seconds and its peak memory above what the process held."""
    import ctypes

    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if loader.startswith("vitkit"):
        import vitkit

        def load(p):
            return vitkit.load(p)
    elif loader == "timm":
        import timm

        def load(p):
            name = timm_name if p == path else "vit_tiny_patch16_224"
            # the files' 1000-class head: timm drops a classifier whose class count its default tag lacks
            return timm.create_model(name, pretrained=True, num_classes=1000,
                                     pretrained_cfg_overlay={"file": p, "num_classes": 1000})
    else:
        from transformers import ViTForImageClassification

        def load(p):
            return ViTForImageClassification.from_pretrained(p)
    load(small)  # the library's imports and first-call work, outside the figure
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = status_mib("VmRSS")
    start = time.perf_counter()
    model = load(path)
    seconds = time.perf_counter() - start
    peak = status_mib("VmHWM") - before
    # A loader may map the file and read it only when the weights are first used: read a value of every
    # page of every weight, the least a first forward pass does, and count that too.
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.detach().reshape(-1)[:: max(1, 4096 // t.element_size())].sum()
    ready = time.perf_counter() - start
    return {"seconds": seconds, "ready_seconds": ready, "peak_above_mib": peak,
            "ready_peak_above_mib": status_mib("VmHWM") - before,
            "params": sum(p.numel() for p in model.parameters())}


def write_files(name: str, folder: Path) -> dict[str, str]:
    """The model `name` with random weights, as vitkit, timm and transformers files; their paths."""
    import torch

    import vitkit
    from vitkit.convert.hf import write_hf
    from vitkit.convert.timm import write_timm

    torch.manual_seed(0)
    model = vitkit.create_model(name)
    out = {"vitkit": folder / "vitkit", "timm": folder / "timm", "hf": folder / "hf"}
    vitkit.save(model, out["vitkit"])
    write_timm(model, out["timm"])
    write_hf(model, out["hf"])
    return {k: str(v) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="write the record here")
    p.add_argument("--worker", nargs=4, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return

    from vitkit.config import get_config
    from vitkit.convert.timm import architecture_name

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        small = write_files("ViT-Ti/16", Path(tmp) / "small")
        for name in args.models:
            files = write_files(name, Path(tmp) / name.replace("/", "-"))
            timm_file = str(Path(files["timm"]) / "model.safetensors")
            small_timm = str(Path(small["timm"]) / "model.safetensors")
            cells = {"vitkit (vitkit folder)": ("vitkit", files["vitkit"], small["vitkit"]),
                     "vitkit (timm file)": ("vitkit-timm", timm_file, small_timm),
                     "timm": ("timm", timm_file, small_timm),
                     "transformers": ("transformers", files["hf"], small["hf"])}
            runs: dict[str, list[dict]] = {c: [] for c in cells}
            for _ in range(args.rounds):
                order = list(cells)
                random.shuffle(order)
                for cell in order:
                    loader, path, warm = cells[cell]
                    cmd = [sys.executable, __file__, "--worker", loader, path, warm,
                           architecture_name(get_config(name))]
                    done = subprocess.run(cmd, capture_output=True, text=True)
                    if done.returncode:
                        raise SystemExit(f"{cell} on {name} failed:\n{done.stderr[-3000:]}")
                    runs[cell].append(json.loads(done.stdout.strip().splitlines()[-1]))
            size = Path(files["vitkit"], "model.safetensors").stat().st_size
            for cell, got in runs.items():
                row = {"model": name, "loader": cell, "file_mib": size / MIB, "params": got[0]["params"]}
                for key in ("seconds", "ready_seconds", "peak_above_mib", "ready_peak_above_mib"):
                    row[key] = statistics.median(r[key] for r in got)
                    row[key + "_all"] = [round(r[key], 3) for r in got]
                row["ready_peak_vs_file"] = row["ready_peak_above_mib"] / row["file_mib"]
                rows.append(row)
                print(f"{name:9} {cell:24} load {row['seconds']:7.3f} s, "
                      f"weights read {row['ready_seconds']:7.3f} s; peak +{row['ready_peak_above_mib']:6.0f} "
                      f"MiB ({row['ready_peak_vs_file']:.2f}x the {row['file_mib']:.0f} MiB file)",
                      flush=True)
    write_rows(rows, args.json)


if __name__ == "__main__":
    main()
