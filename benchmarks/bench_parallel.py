"""FSDP against DDP (vitkit.train's `parallel` setting) at 2 CPU processes: step time, peak memory, and the
bytes of parameters, gradients and optimizer state each process holds.

Each cell (model x strategy) is a fresh `torchrun --standalone --nproc_per_node 2` of this file's worker:
the model as the trainer builds it (`vitkit.accelerate`, then DDP or `vitkit.train.sharding.shard`), the
trainer's AdamW, one step's forward and backward through `forward_backward` and `optimizer_step`, on a random
batch at 224 px. One step warms up; the step time is the median of the timed steps on process 0. Peak RSS
is each process's high-water mark (`ru_maxrss`) over the whole cell, model building included (every process
builds the whole model before it is sharded, as the trainer does); beside it the RSS after the steps, once
glibc has returned the memory freed.
The state bytes are counted tensor by tensor on each process (its shard's under FSDP): parameters, gradients
(before they are cleared) and the optimizer's moments; DDP's gradient buckets, a further gradient-sized
buffer, are not counted.

    python benchmarks/bench_parallel.py --json $(python benchmarks/records.py name parallel)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("ViT-S/16", "ViT-B/16")
STRATEGIES = ("ddp", "fsdp")


def local_bytes(tensors) -> int:
    """The bytes of `tensors` on this process: a DTensor's local shard, a tensor whole."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def rss_now() -> int:
    """This process's resident memory now, in bytes (Linux's /proc/self/statm), after glibc has handed back
    the heap it keeps of freed memory (malloc_trim): what the process still holds, not what it once did."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def worker(model_name: str, parallel: str, batch: int, steps: int, out: str) -> None:
    """One cell, run by each of torchrun's processes; process 0 writes the cell's figures to `out`."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import vitkit
    from vitkit.train import distributed, sharding
    from vitkit.train.one_step import forward_backward, optimizer_step
    from vitkit.train.optim import build_optimizer
    from vitkit.train.settings import OptimConfig

    torch.set_num_threads(1)
    ctx = distributed.setup("cpu")
    torch.manual_seed(0)
    model = vitkit.accelerate(vitkit.create_model(model_name))
    if parallel == "fsdp":
        net = sharding.shard(model, sharding.device_mesh(ctx.device, ctx.world))
    else:
        net = DistributedDataParallel(model)
    optimizer = build_optimizer(model, OptimConfig(name="adamw", lr=1e-4, weight_decay=0.05))
    per_process = batch // ctx.world
    x = torch.randn(per_process, 3, 224, 224)
    y = torch.randint(0, model.cfg.num_classes, (per_process,))
    times, grads = [], 0
    for _ in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        forward_backward(net, [(x, y)], F.cross_entropy, ctx.device, None)
        grads = local_bytes(p.grad for p in model.parameters() if p.grad is not None)
        optimizer_step(model, optimizer)
        times.append(time.perf_counter() - start)
    state = local_bytes(v for s in optimizer.state.values() for v in s.values()
                        if torch.is_tensor(v) and v.dim() > 0)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux counts kilobytes
    mine = {"params_bytes": local_bytes(model.parameters()), "grads_bytes": grads,
            "optimizer_state_bytes": state, "peak_rss_bytes": peak_rss, "rss_after_steps_bytes": rss_now()}
    mine["params_grads_optimizer_bytes"] = mine["params_bytes"] + grads + state
    everyone = distributed.gather_strings([json.dumps(mine)])
    if ctx.is_main:
        cell = {"model": model_name, "parallel": parallel, "processes": ctx.world, "batch": batch,
                "threads_per_process": 1, "step_ms": 1000 * statistics.median(times[1:]),
                "step_ms_all": [round(1000 * t, 1) for t in times[1:]],
                "per_process": [json.loads(s) for s in everyone]}
        Path(out).write_text(json.dumps(cell))
    distributed.teardown()


def run_cell(model_name: str, parallel: str, batch: int, steps: int, nproc: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cell.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               __file__, "--worker", model_name, parallel, str(batch), str(steps), str(out)]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--batch", type=int, default=4, help="the global batch (split over the processes)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per cell, after one of warm-up")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--json", default=None, help="write the record here")
    p.add_argument("--worker", nargs=5, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        model_name, parallel, batch, steps, out = args.worker
        worker(model_name, parallel, int(batch), int(steps), out)
        return
    import torch

    from vitkit.bench import machine_info, write_json

    rows = [run_cell(m, s, args.batch, args.steps, args.nproc) for m in args.models for s in STRATEGIES]
    for m in args.models:
        ddp, fsdp = (next(r for r in rows if r["model"] == m and r["parallel"] == s) for s in STRATEGIES)
        state = [max(c["params_grads_optimizer_bytes"] for c in r["per_process"]) for r in (ddp, fsdp)]
        rss = [max(c["peak_rss_bytes"] for c in r["per_process"]) for r in (ddp, fsdp)]
        after = [max(c["rss_after_steps_bytes"] for c in r["per_process"]) for r in (ddp, fsdp)]
        fsdp["state_vs_ddp"] = state[1] / state[0]
        fsdp["peak_rss_vs_ddp"] = rss[1] / rss[0]
        fsdp["rss_after_steps_vs_ddp"] = after[1] / after[0]
        fsdp["step_time_vs_ddp"] = fsdp["step_ms"] / ddp["step_ms"]
        for r, s, m_rss, m_after in zip((ddp, fsdp), state, rss, after, strict=True):
            print(f"{m} {r['parallel']}: {r['step_ms']:.0f} ms/step, peak RSS {m_rss / 2**20:.0f} MiB, RSS "
                  f"after the steps {m_after / 2**20:.0f} MiB, params+grads+optimizer {s / 2**20:.0f} MiB "
                  "per process")
        print(f"{m} fsdp/ddp: state {fsdp['state_vs_ddp']:.3f}, peak RSS {fsdp['peak_rss_vs_ddp']:.3f}, "
              f"RSS after {fsdp['rss_after_steps_vs_ddp']:.3f}, step time {fsdp['step_time_vs_ddp']:.3f}")
    record = {"machine": machine_info(), "torch": torch.__version__, "command": " ".join(sys.argv),
              "rows": rows}
    if args.json:
        write_json(record, args.json)


if __name__ == "__main__":
    main()
