"""Which state a shared 2-vCPU machine is in, round by round, and what it does to the batch-1 ratios.

Some speed cells (ViT-S/16 at batch 1 for `optimize(fp32)` and `optimize(int8)`, and the ViT-S/16 training
step) move with the machine's state more than with the code (docs/speed.md). Each round
here times, in a fresh random order: the int8 model with 2 threads and with 1, `optimize(fp32)` and timm with 2,
and a small matrix product on each vCPU at once (one thread pinned to each): per-core speed while both run.
The 1- and 2-thread int8 times give the two-thread speed-up; at the end the rounds are split into the
faster and the slower half by the int8 model's 2-thread time, with the medians of each half.

    .venv/bin/python benchmarks/machine_state.py --seconds 120 --json state.json
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time

import torch

import vitkit
from vitkit.bench import build_timm, write_json


def time_call(fn, threads: int) -> float:
    """Seconds for one call of fn with `threads` intra-op threads (restored to 2 afterwards)."""
    torch.set_num_threads(threads)
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        torch.set_num_threads(2)


def per_core_seconds(calls: int = 200, size: int = 256) -> dict[int, float]:
    """Seconds per size^3 matrix product on vCPUs 0 and 1 at the same time, one thread pinned to each; empty
    where threads cannot be pinned (not Linux) or the machine has fewer than two CPUs."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return {}
    cpus = sorted(os.sched_getaffinity(0))[:2]
    a, b = torch.randn(size, size), torch.randn(size, size)
    out: dict[int, float] = {}

    def work(cpu: int) -> None:
        os.sched_setaffinity(0, {cpu})  # 0: this thread
        start = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b)
        out[cpu] = (time.perf_counter() - start) / calls

    torch.set_num_threads(1)
    try:
        workers = [threading.Thread(target=work, args=(cpu,)) for cpu in cpus]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        torch.set_num_threads(2)
    return out


def summarise(rounds: list[dict]) -> dict:
    """Medians over the faster and the slower half of the rounds (by the int8 model's 2-thread time)."""
    ordered = sorted(rounds, key=lambda r: r["int8_2"])
    half = len(ordered) // 2
    halves = {"faster half": ordered[:max(half, 1)], "slower half": ordered[half:]}
    return {name: {"rounds": len(rows)} | {key: statistics.median(r[key] for r in rows) for key in rows[0]}
            for name, rows in halves.items()}


def measure(contenders: dict, x: torch.Tensor, seconds: float) -> list[dict]:
    """Rounds until `seconds` have passed (at least one): every job once in a fresh random order, then the
    per-core products; printed as they come."""
    jobs = {"int8_2": ("int8", 2), "int8_1": ("int8", 1), "fp32_opt_2": ("fp32_opt", 2), "timm_2": ("timm", 2)}
    rounds: list[dict] = []
    with torch.inference_mode():
        for net in contenders.values():
            net(x)
        deadline = time.monotonic() + seconds
        while not rounds or time.monotonic() < deadline:
            row = {}
            for key in random.sample(list(jobs), len(jobs)):
                name, threads = jobs[key]
                row[key] = time_call(lambda net=contenders[name]: net(x), threads)
            cores = per_core_seconds()
            row.update({f"mm_cpu{cpu}": s for cpu, s in sorted(cores.items())})
            row["speedup_2_threads"] = row["int8_1"] / row["int8_2"]
            row["int8_vs_timm"] = row["timm_2"] / row["int8_2"]
            row["fp32_opt_vs_timm"] = row["timm_2"] / row["fp32_opt_2"]
            rounds.append(row)
            cores_ms = " ".join(f"cpu{cpu} {1e6 * s:.0f} us" for cpu, s in sorted(cores.items()))
            print(f"int8 {1e3 * row['int8_2']:6.1f} ms (1 thread {1e3 * row['int8_1']:6.1f}, two-thread speed-up "
                  f"{row['speedup_2_threads']:.2f}x) | optimize(fp32) {1e3 * row['fp32_opt_2']:6.1f} | timm "
                  f"{1e3 * row['timm_2']:6.1f} | vs timm: int8 {row['int8_vs_timm']:.2f}x fp32 "
                  f"{row['fp32_opt_vs_timm']:.2f}x | mm {cores_ms}", flush=True)
    return rounds


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ViT-S/16", help="vitkit preset (default ViT-S/16)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seconds", type=float, default=120.0, help="how long to keep measuring")
    p.add_argument("--json", default=None, help="write every round and the summary here")
    args = p.parse_args(argv)
    try:
        cfg = vitkit.get_config(args.model)
    except (KeyError, ValueError) as e:
        p.error(e.args[0] if e.args else str(e))
    torch.manual_seed(0)
    model = vitkit.create_model(cfg).eval()
    contenders = {"int8": vitkit.optimize(model, "int8"), "fp32_opt": vitkit.optimize(model, "fp32"),
                  "timm": build_timm(cfg).eval()}
    x = torch.randn(args.batch, cfg.in_chans, *cfg.image_size)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rounds = measure(contenders, x, args.seconds)
    finally:
        torch.set_num_threads(threads_before)
    summary = summarise(rounds)
    for name, med in summary.items():
        print(f"{name} ({med['rounds']} rounds of {len(rounds)}): int8 {1e3 * med['int8_2']:.1f} ms, "
              f"1 thread {1e3 * med['int8_1']:.1f} ms, two-thread speed-up {med['speedup_2_threads']:.2f}x, "
              f"int8/timm {med['int8_vs_timm']:.2f}x, fp32/timm {med['fp32_opt_vs_timm']:.2f}x")
    report = {"model": cfg.name, "batch": args.batch, "rounds": rounds, "summary": summary}
    if args.json:
        write_json(report, args.json)
    return report


if __name__ == "__main__":
    main()
