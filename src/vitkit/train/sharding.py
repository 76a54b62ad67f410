"""FSDP2 for `parallel=fsdp`: the model's parameters, gradients and optimizer state sharded over the
processes, in the manner of torchtitan's `apply_fsdp`.

`fully_shard` wraps each encoder block, then the root (the patch embedding, tokens, final norm and head).
A block's parameters are all-gathered just before its forward and freed after it (and again for its
backward), so a process holds whole parameters for one block at a time; gradients are reduce-scattered
(averaged) as each block's backward ends. The last block keeps its parameters after the forward, as the
backward needs them at once. The mesh is named explicitly on the CPU (gloo; pytorch#132471), and on GPUs
(nccl) the parameters compute in bf16 and the gradients reduce in fp32 (`MixedPrecisionPolicy`).

No process builds the whole model unless it must: `shard_from_main` builds the model on the meta device
(shapes only), shards it, allocates each process's shards, and fills them from the main process, the only one
that built the model whole (with the seed, or from a checkpoint: the weights DDP starts from); the EMA is
sharded alike from the model's shards (`sharded_copy`). Peak memory is then a process's shards, plus the main
process's whole model while it is handed out, as in torchtitan.

vitkit's CPU kernels (`vitkit.accelerate`) compose with it: they swap module classes and keep the parameter
objects, whether before `fully_shard` (which swaps the block's class again, FSDPBlock) or after it; either
way the kernels see the whole parameters that FSDP gathers for the forward.

A single process has nothing to shard: `shard` is only called with two or more, and a one-process
`parallel=fsdp` run trains the plain model (its checkpoints are still sharded ones, so that it resumes on more
processes and they on it).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config import ViTConfig
from ..model import VisionTransformer


def device_mesh(device: torch.device, world: int):
    """The one-dimensional mesh of the `world` processes, on `device`'s type ("cpu" or "cuda")."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world,))


def mixed_precision(device: torch.device):
    """bf16 parameters with fp32 gradient reduction on a GPU; None (fp32 throughout) on a CPU, whose
    training keeps fp32 as DDP's does."""
    if device.type != "cuda":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard(model: VisionTransformer, mesh, policy=None) -> VisionTransformer:
    """`fully_shard` every block of `model`, then the root, in place (module docstring); returns `model`.
    Its parameters become DTensors holding this process's shard; build the optimizer after this."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = policy or MixedPrecisionPolicy()
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(model.blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def empty_sharded(cfg: ViTConfig, mesh, device: torch.device, policy=None) -> VisionTransformer:
    """A model of `cfg`, sharded over `mesh`, with this process's shards allocated on `device` and not set
    (buffers included): built on the meta device, so no process holds it whole."""
    with torch.device("meta"):
        model = VisionTransformer(cfg)
    shard(model, mesh, policy)
    return model.to_empty(device=device)


def shard_from_main(model: VisionTransformer | None, cfg: ViTConfig, mesh, device: torch.device,
                    policy=None) -> VisionTransformer:
    """The main process's `model` (None on the others), sharded over `mesh` on every process: an
    `empty_sharded` model whose shards each process receives from the main one, tensor by tensor
    (set_model_state_dict with broadcast_from_rank0), buffers included. A collective."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    main = model is not None
    sharded = empty_sharded(cfg, mesh, device, policy)
    full = {k: v.to(device) for k, v in model.state_dict().items()} if main else {}
    set_model_state_dict(sharded, full, options=StateDictOptions(full_state_dict=True,
                                                                 broadcast_from_rank0=True))
    del full
    with torch.no_grad():  # the buffers (the fixed sin-cos table) are not sharded, nor all in the state dict
        for name, buffer in sharded.named_buffers():
            if main:
                buffer.copy_(model.get_buffer(name))
            dist.broadcast(buffer, src=0)
    return sharded


def sharded_copy(model: VisionTransformer, mesh, device: torch.device, policy=None) -> VisionTransformer:
    """A copy of a sharded `model`, sharded alike: each process copies its own shards, with no communication
    and no whole model anywhere (the EMA's module under FSDP)."""
    copy = empty_sharded(model.cfg, mesh, device, policy)
    with torch.no_grad():
        for mine, theirs in zip(copy.parameters(), model.parameters(), strict=True):
            mine.copy_(theirs)
        for mine, theirs in zip(copy.buffers(), model.buffers(), strict=True):
            mine.copy_(theirs)
    copy.patch_drop_rate = model.patch_drop_rate
    return copy


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` was sharded by `shard` (its parameters are DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def gathered_copy(model: VisionTransformer, fast: bool = False) -> VisionTransformer:
    """A plain VisionTransformer with `model`'s whole weights, on every process: what evaluation (each process
    its share of the images) and the plain checkpoints (best/, last/) use. A collective under FSDP: every
    process must call it. `fast`: with vitkit's CPU kernels swapped in, as the trained model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ..cpu import accelerate

    if not is_sharded(model):
        return model
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    device = next(iter(full.values())).device
    with torch.device("meta"):
        copy = VisionTransformer(model.cfg)
    copy.to_empty(device=device)
    copy.load_state_dict(full)
    with torch.no_grad():  # the buffers, persistent or not (the fixed sin-cos table), are not sharded
        kept = dict(model.named_buffers())
        for name, buffer in copy.named_buffers():
            buffer.copy_(kept[name])
    copy.patch_drop_rate = model.patch_drop_rate
    copy.train(model.training)
    return accelerate(copy) if fast else copy
