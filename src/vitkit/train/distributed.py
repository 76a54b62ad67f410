"""Processes and devices: one code path for a single process and for torchrun on one machine or several (DDP
with gloo on CPUs, nccl on GPUs). torchrun tells each process its place through RANK, WORLD_SIZE and
LOCAL_RANK."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Context:
    """Where this process stands: its rank among `world` processes and the device it computes on."""

    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """'auto' is this process's GPU when there is one, else the CPU; 'cuda' means cuda:LOCAL_RANK.

    With GPUs, each process of a machine takes its own (LOCAL_RANK): more processes than GPUs is an error
    (naming both numbers), not a silent fall-back to the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch finds no GPU; use device=cpu or auto")
        gpus = torch.cuda.device_count()
        if local_rank >= gpus:
            raise ValueError(
                f"process LOCAL_RANK={local_rank} needs GPU cuda:{local_rank}, but this machine has {gpus}: "
                f"start at most {gpus} process(es) per machine (--nproc, torchrun --nproc_per_node), or "
                "train on the CPU with --set device=cpu")
        return torch.device("cuda", local_rank)
    return torch.device(name)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send this process `sig` when its parent ends, however it ends (SIGKILL included).

    torchrun starts each worker in a session of its own, so killing torchrun, or the process group of a
    `vitkit train --nproc N`, would leave the workers training on, unseen, into the same run folder. Returns
    whether the request was made (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the parent ended before the request took effect
        os.kill(os.getpid(), sig)
    return True


def shared_store_warning(env: dict[str, str]) -> str | None:
    """A warning when torchrun may restart the workers (--max-restarts) while they share its store.

    torchrun keeps that store across restarts, so a restarted worker group can read the addresses the group
    it replaces published there, and fail to connect (gloo: "Connection refused").
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment gives each group a store of its own."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if not restarts.isdigit() or int(restarts) == 0:
        return None
    return (f"warning: torchrun --max-restarts {restarts} with the store it shares with its workers: a "
            "restarted group may read the addresses of the one it replaces and fail to connect; start "
            "torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (docs/distributed.md)")


def setup(device: str = "auto") -> Context:
    """Join the process group when started by torchrun (WORLD_SIZE > 1), else a single process. A torchrun
    worker ends with torchrun (end_with_parent); the main one warns of restarts that would fail to connect
    (shared_store_warning)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        end_with_parent()
        warning = shared_store_warning(dict(os.environ))
        if warning and rank == 0 and world > 1:
            print(warning, file=sys.stderr, flush=True)
    dev = pick_device(device, local_rank)
    if world > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return Context(rank=rank, world=world, local_rank=local_rank, device=dev)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def data_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """`model` under DistributedDataParallel as vitkit trains it: each gradient a view into DDP's all-reduce
    buckets (`gradient_as_bucket_view`), so that a process holds one gradient-sized buffer, not two (the
    gradients autograd writes and the buckets they are copied into; docs/training.md gives the figures)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, gradient_as_bucket_view=True)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over the processes, in place (a no-op for a single process). NCCL reduces only GPU tensors: a
    CPU tensor (evaluation's counts) goes through this process's GPU and back."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl" and t.device.type != "cuda":
            on_gpu = t.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(on_gpu, op=dist.ReduceOp.SUM)
            t.copy_(on_gpu)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_strings(items: list[str]) -> list[str]:
    """Every process's `items`, concatenated in rank order (this process's own for a single process). A
    collective: every process must call it."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(items)
    lists: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(lists, list(items))
    return [item for part in lists for item in part or []]


def broadcast_string(text: str) -> str:
    """Process 0's `text`, on every process (`text` itself for a single process). A collective."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return text
    box = [text]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def agree(value: int, device: torch.device | str = "cpu") -> bool:
    """Whether every process holds the same integer `value` (always, for a single process)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return True
    t = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the largest value and minus the smallest
    return int(t[0]) == -int(t[1])
