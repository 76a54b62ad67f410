"""FSDP against DDP (vitkit.train's `parallel` setting) at 2 CPU processes: step time, peak memory, and the
bytes of parameters, gradients and optimizer state each process holds.

Each cell (model x strategy) is a fresh `torchrun --standalone --nproc_per_node 2` of this file's worker,
which builds the model as the trainer does: under DDP every process builds it whole (`vitkit.accelerate`, then
DistributedDataParallel with the gradients in its buckets: `vitkit.train.distributed.data_parallel`); under
FSDP only process 0 does, and every process receives its shards (`vitkit.train.sharding.shard_from_main`, then
`vitkit.accelerate`), with large blocks given back to the kernel as the trainer's FSDP processes do
(`vitkit.cpu.allocator.return_large_blocks`). Then the trainer's AdamW, and each step's forward and backward
through `forward_backward` and `optimizer_step` on a random batch at 224 px. One step warms up; the step time
is the median of the timed steps on process 0. Peak RSS is each process's high-water mark (VmHWM in
/proc/self/status) over the whole cell, model building included; beside it the RSS after the steps, once glibc
has returned the memory freed, and the RSS before the model (the libraries, the files among them mapped in
shared with the other process: the floor every process starts from, whatever the strategy). The state bytes
are counted tensor by tensor on each process (its shard's under FSDP): parameters, gradients (before they are
cleared) and the optimizer's moments (DDP's gradients are its buckets).

A cell whose processes together hold more than `--rss-limit-gib` is stopped (the machine would otherwise
run out of memory) and recorded as such, with the resident memory it had reached.

    python benchmarks/bench_parallel.py --json $(python benchmarks/records.py name parallel)
    python benchmarks/bench_parallel.py --models ViT-H/14 --batch 2 --steps 2
    python benchmarks/bench_parallel.py --grad-checkpointing     # activation checkpointing in both
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from records import write_rows

MODELS = ("ViT-B/16", "ViT-L/16")
STRATEGIES = ("ddp", "fsdp")
GIB = 2**30


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


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A memory field of /proc/PID/status (VmHWM: the peak resident memory; VmRSS: now), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # the kernel counts kB
    raise ValueError(f"/proc/{pid}/status has no {field}")


def worker(model_name: str, parallel: str, batch: int, steps: int, checkpointing: bool, out: str) -> None:
    """One cell, run by each of torchrun's processes; process 0 writes the cell's figures to `out`."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import vitkit
    from vitkit.config import get_config
    from vitkit.cpu.allocator import return_large_blocks
    from vitkit.train import distributed, sharding
    from vitkit.train.one_step import forward_backward, optimizer_step
    from vitkit.train.optim import build_optimizer
    from vitkit.train.settings import OptimConfig

    torch.set_num_threads(1)
    ctx = distributed.setup("cpu")
    # what the process holds before any model: the libraries (shared files mapped in, RssFile, among them)
    floor = {"rss_before_model_bytes": status_bytes("VmRSS"),
             "rss_file_before_model_bytes": status_bytes("RssFile")}
    torch.manual_seed(0)
    if parallel == "fsdp":  # as the trainer builds it: whole on process 0 only, large blocks given back
        return_large_blocks()
        whole = vitkit.create_model(model_name) if ctx.is_main else None
        mesh = sharding.device_mesh(ctx.device, ctx.world)
        model = sharding.shard_from_main(whole, get_config(model_name), mesh, ctx.device)
        del whole
        net = vitkit.accelerate(model)
    else:
        model = vitkit.accelerate(vitkit.create_model(model_name))
        net = distributed.data_parallel(model) if ctx.distributed else model  # one process: as the trainer
    model.set_grad_checkpointing(checkpointing)  # as the trainer's grad_checkpointing setting
    optimizer = build_optimizer(model, OptimConfig(name="adamw", lr=1e-4, weight_decay=0.05))
    per_process = batch // ctx.world
    x = torch.randn(per_process, 3, 224, 224)
    y = torch.randint(0, model.cfg.num_classes, (per_process,))
    times, grads = [], 0
    for _ in range(steps + 1):
        if ctx.distributed:
            dist.barrier()
        start = time.perf_counter()
        forward_backward(net, [(x, y)], F.cross_entropy, ctx.device, None)
        grads = local_bytes(p.grad for p in model.parameters() if p.grad is not None)
        optimizer_step(model, optimizer)
        times.append(time.perf_counter() - start)
    state = local_bytes(v for s in optimizer.state.values() for v in s.values()
                        if torch.is_tensor(v) and v.dim() > 0)
    peak_rss = status_bytes("VmHWM")
    mine = {"params_bytes": local_bytes(model.parameters()), "grads_bytes": grads,
            "optimizer_state_bytes": state, "peak_rss_bytes": peak_rss, "rss_after_steps_bytes": rss_now(),
            **floor}
    mine["params_grads_optimizer_bytes"] = mine["params_bytes"] + grads + state
    everyone = distributed.gather_strings([json.dumps(mine)])
    if ctx.is_main:
        cell = {"model": model_name, "parallel": parallel, "processes": ctx.world, "batch": batch,
                "grad_checkpointing": checkpointing, "threads_per_process": 1,
                "step_ms": 1000 * statistics.median(times[1:]),
                "step_ms_all": [round(1000 * t, 1) for t in times[1:]],
                "per_process": [json.loads(s) for s in everyone]}
        Path(out).write_text(json.dumps(cell))
    distributed.teardown()


def descendants(pid: int) -> list[int]:
    """The processes started, directly or not, by `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run_cell(model_name: str, parallel: str, batch: int, steps: int, nproc: int, rss_limit: int,
             checkpointing: bool = False) -> dict:
    """One cell's figures; a cell whose processes together exceed `rss_limit` bytes is stopped and returned
    as {'stopped': ...} with the memory reached."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cell.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               __file__, "--worker", model_name, parallel, str(batch), str(steps), str(int(checkpointing)),
               str(out)]
        proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        reached = 0
        while proc.poll() is None:
            held = 0
            for pid in descendants(proc.pid):
                with contextlib.suppress(OSError, ValueError):
                    held += status_bytes("VmRSS", pid)
            reached = max(reached, held)
            if held > rss_limit:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return {"model": model_name, "parallel": parallel, "processes": nproc, "batch": batch,
                        "grad_checkpointing": checkpointing,
                        "stopped": f"the {nproc} processes held {held / GIB:.1f} GiB, over the limit of "
                                   f"{rss_limit / GIB:.1f} GiB, before the cell ended",
                        "rss_reached_bytes": reached}
            time.sleep(0.2)
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, cmd)
        cell = json.loads(out.read_text())
        cell["rss_reached_bytes"] = reached  # the processes' summed RSS, sampled every 0.2 s
        return cell


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--batch", type=int, default=4, help="the global batch (split over the processes)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per cell, after one of warm-up")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--rss-limit-gib", type=float, default=20.0,
                   help="stop a cell whose processes together hold more than this (GiB)")
    p.add_argument("--json", default=None, help="write the record here")
    p.add_argument("--grad-checkpointing", action="store_true",
                   help="recompute each block's activations in the backward pass (the trainer's "
                        "grad_checkpointing), in both strategies")
    p.add_argument("--worker", nargs=6, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        model_name, parallel, batch, steps, checkpointing, out = args.worker
        worker(model_name, parallel, int(batch), int(steps), checkpointing == "1", out)
        return
    limit = int(args.rss_limit_gib * GIB)
    rows = [run_cell(m, s, args.batch, args.steps, args.nproc, limit, args.grad_checkpointing)
            for m in args.models for s in args.strategies]
    for row in rows:
        if "stopped" in row:
            print(f"{row['model']} {row['parallel']}: stopped: {row['stopped']}")
            continue
        peaks = [c["peak_rss_bytes"] / GIB for c in row["per_process"]]
        state = max(c["params_grads_optimizer_bytes"] for c in row["per_process"]) / GIB
        print(f"{row['model']} {row['parallel']}: {row['step_ms']:.0f} ms/step, peak RSS per process "
              f"{', '.join(f'{p:.2f}' for p in peaks)} GiB, params+grads+optimizer {state:.2f} GiB")
    for m in args.models if len(args.strategies) == 2 else ():
        ddp, fsdp = (next(r for r in rows if r["model"] == m and r["parallel"] == s) for s in STRATEGIES)
        if "stopped" in ddp or "stopped" in fsdp:
            continue
        state = [max(c["params_grads_optimizer_bytes"] for c in r["per_process"]) for r in (ddp, fsdp)]
        rss = [max(c["peak_rss_bytes"] for c in r["per_process"]) for r in (ddp, fsdp)]
        after = [max(c["rss_after_steps_bytes"] for c in r["per_process"]) for r in (ddp, fsdp)]
        fsdp["state_vs_ddp"] = state[1] / state[0]
        fsdp["peak_rss_vs_ddp"] = rss[1] / rss[0]
        fsdp["rss_after_steps_vs_ddp"] = after[1] / after[0]
        fsdp["step_time_vs_ddp"] = fsdp["step_ms"] / ddp["step_ms"]
        # the peak above what each process held before its model (the libraries), the larger process's
        above = [max(c["peak_rss_bytes"] - c["rss_before_model_bytes"] for c in r["per_process"])
                 for r in (ddp, fsdp)]
        fsdp["peak_rss_above_floor_vs_ddp"] = above[1] / above[0]
        print(f"{m} fsdp/ddp: state {fsdp['state_vs_ddp']:.3f}, peak RSS (the larger process's) "
              f"{fsdp['peak_rss_vs_ddp']:.3f}, above the libraries' floor {above[1] / above[0]:.3f}, "
              f"RSS after {fsdp['rss_after_steps_vs_ddp']:.3f}, step time {fsdp['step_time_vs_ddp']:.3f}")
    write_rows(rows, args.json)


if __name__ == "__main__":
    main()
