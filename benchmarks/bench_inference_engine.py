"""The accelerated model's inference products on oneDNN against MKL (vitkit.cpu.linear), in one process.

With tuning off, vitkit.cpu.linear.FastLinear multiplies without a gradient on the engine
`inference_engine(rows)` picks: MKL up to two rows, on Intel CPUs also from MKL_FROM_ROWS rows (four images)
on, oneDNN otherwise. This script times the accelerated model (as `vitkit bench` builds it) at several batch
sizes three ways,
interleaved in a fresh random order each round: every product of more than two rows on oneDNN ("onednn", the
rule before), every product on MKL ("mkl"), and the rule ("auto"). Ratios are paired (vitkit.bench.paired_ratio):
how many times faster than "onednn" each way is, so above 1 means faster.

    .venv/bin/python benchmarks/bench_inference_engine.py --threads 2
    .venv/bin/python benchmarks/bench_inference_engine.py --threads 2 -m ViT-B/16 -b 1 -b 16 --json engine.json

With --layers, each linear layer shape of the models at batch 1 and at the largest batch as well, the two
engines interleaved (`F.linear` against oneDNN's linear on the plain weight).
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
import torch.nn.functional as F

import vitkit
from vitkit.bench import build_vitkit, describe_cpu, interleaved_times, machine_info, paired_ratio, write_json
from vitkit.config import get_config
from vitkit.cpu.linear import forced_inference_engine, inference_engine
from vitkit.cpu.private import onednn_linear

ENGINES = ("onednn", "mkl", "auto")


def on_engine(model: torch.nn.Module, x: torch.Tensor, engine: str):
    def call() -> torch.Tensor:
        with forced_inference_engine(engine):
            return model(x)

    return call


def timed_engines(calls: dict, repeats: int, warmup: int, rng: random.Random) -> dict[str, float]:
    """The calls (one per engine, "onednn" among them) interleaved: each one's median ms (`ms_<engine>`) and,
    for the others, its paired speed-up over oneDNN (`<engine>_speedup`)."""
    times = interleaved_times(calls, repeats, warmup, rng)
    out = {f"ms_{e}": 1e3 * statistics.median(t) for e, t in times.items()}
    out.update({f"{e}_speedup": paired_ratio(t, [times["onednn"]]) for e, t in times.items() if e != "onednn"})
    return out


def model_rows(names: list[str], batches: list[int], repeats: int, rng: random.Random) -> list[dict]:
    """Each accelerated model at each batch size, the three ways (ENGINES) interleaved: medians and paired speed-ups."""
    out = []
    with torch.inference_mode():
        for name in names:
            cfg = get_config(name)
            model = build_vitkit(cfg).eval()
            for batch in batches:
                x, n_rows = torch.randn(batch, 3, *cfg.image_size), batch * cfg.num_tokens
                row = {"model": name, "batch": batch, "rows": n_rows, "auto_engine": inference_engine(n_rows)}
                row.update(timed_engines({e: on_engine(model, x, e) for e in ENGINES}, repeats, 1, rng))
                out.append(row)
                print(f"{name:<9} batch {batch:>3} ({row['rows']:>5} rows, auto = {row['auto_engine']:<6}): "
                      + "  ".join(f"{e} {row[f'ms_{e}']:8.1f} ms" for e in ENGINES)
                      + f"   mkl {row['mkl_speedup']:.3f}x, auto {row['auto_speedup']:.3f}x oneDNN's", flush=True)
    return out


def layer_rows(names: list[str], batches: list[int], repeats: int, rng: random.Random) -> list[dict]:
    """Each layer shape of the models at the smallest and largest batch's rows, oneDNN and MKL interleaved."""
    out = []
    with torch.inference_mode():
        for name in names:
            cfg = get_config(name)
            shapes = sorted({(cfg.dim, 3 * cfg.dim), (cfg.dim, cfg.dim), (cfg.dim, cfg.mlp_dim), (cfg.mlp_dim, cfg.dim)})
            for n in sorted({min(batches), max(batches)}):
                n_rows = n * cfg.num_tokens
                for fan_in, fan_out in shapes:
                    x, w, b = torch.randn(n_rows, fan_in), torch.randn(fan_out, fan_in), torch.randn(fan_out)
                    calls = {"onednn": lambda x=x, w=w, b=b: onednn_linear(x, w, b),
                             "mkl": lambda x=x, w=w, b=b: F.linear(x, w, b)}
                    row = {"model": name, "rows": n_rows, "in": fan_in, "out": fan_out}
                    row.update(timed_engines(calls, repeats, 2, rng))
                    out.append(row)
                    print(f"{name:<9} {n_rows:>5} rows {fan_in:>5} -> {fan_out:<5}: oneDNN {row['ms_onednn']:8.2f} ms, "
                          f"MKL {row['ms_mkl']:8.2f} ms, MKL {row['mkl_speedup']:.3f}x", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", action="append", help="preset (repeat; default ViT-S/16 and ViT-B/16)")
    parser.add_argument("-b", "--batch", action="append", type=int, help="batch size (repeat; default 1 2 4 16)")
    parser.add_argument("--repeats", type=int, default=12, help="rounds per cell (median and paired ratio)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--layers", action="store_true", help="also time each layer shape on both engines")
    parser.add_argument("--seed", type=int, default=0, help="seed of the rounds' order")
    parser.add_argument("--json", help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    names = args.model or ["ViT-S/16", "ViT-B/16"]
    batches = args.batch or [1, 2, 4, 16]
    if min(batches) < 1:
        parser.error(f"--batch must be at least 1, got {min(batches)}")
    for name in names:
        try:
            get_config(name)  # an unknown preset fails here, before any timing
        except KeyError as e:
            parser.error(e.args[0])
    previous_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        vitkit.retain_freed_memory()  # as `vitkit bench` runs every contender
        info = machine_info()
        print(f"{describe_cpu(info)}; {torch.get_num_threads()} thread(s); {args.repeats} rounds", flush=True)
        rng = random.Random(args.seed)
        report = {"machine": info, "threads": torch.get_num_threads(), "repeats": args.repeats,
                  "models": model_rows(names, batches, args.repeats, rng)}
        if args.layers:
            report["layers"] = layer_rows(names, batches, args.repeats, rng)
    finally:
        torch.set_num_threads(previous_threads)
    if args.json:
        write_json(report, args.json)
    return report


if __name__ == "__main__":
    main()
