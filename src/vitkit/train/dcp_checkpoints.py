"""Sharded training checkpoints for `parallel=fsdp`, through torch.distributed.checkpoint (DCP), in the manner
of torchtitan's checkpointer: `get_state_dict`/`set_state_dict` name every tensor by its parameter's name, so
a checkpoint written by N processes loads into M (DCP reshards on load), or into one plain model.

    RUN/ckpt/step-0000400/
        dcp/                     model, optimizer and EMA: each process writes its own shards (__R_0.distcp)
                                 and process 0 the index (.metadata)
        rng/rank-00000.safetensors, rng/rank-00000.json
                                 every process's generator states (torch's CPU and CUDA; numpy's, Python's)
        state.json               step, epoch, position in the epoch, best metric, time, processes, "format":
                                 "dcp" and the torch version that wrote it

As checkpoints.py's: written into a `.tmp-*` folder that process 0 renames into place once every process has
written its part (a killed save leaves the previous checkpoint as it was), and best/, last/ stay plain vitkit
checkpoints. DCP loads in place: the optimizer's state must exist before the load, which `get_state_dict`
sees to (it steps the fresh optimizer once at learning rate 0). DCP's files are not promised to load under
another PyTorch version: state.json records the version, and a resume under another says so.

Generators on resume: with as many processes as wrote the checkpoint, each takes back its own states. With
another number there is nothing to take back: the trainer's draws are functions of (seed, epoch, step, the
image's place in the global batch) (vitkit.streams), so they do not depend on the generators' states.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import load_file

from ..checkpoint import CheckpointError
from ..files import permit_as_created, save_safetensors
from . import distributed
from .checkpoints import STATE_NAME, capture_rng, prune, put_in_place, restore_rng, step_dir_name
from .ema import EMA

DCP_NAME = "dcp"
RNG_NAME = "rng"
FORMAT = "dcp"



@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every save and load of a single process ("assuming the intent is to ... in a single
    process"), which is what vitkit asks for with no_dist: that warning, and only it, is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*assuming the intent is to \w+ in a single process",
                                category=UserWarning)
        yield



def is_sharded_checkpoint(ckpt: Path) -> bool:
    return (Path(ckpt) / DCP_NAME).is_dir()


def tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA | None) -> dict[str, Any]:
    """The tensors DCP saves and loads: {'model', 'optim'[, 'ema']}, keyed by parameter names (sharded
    DTensors under FSDP, plain tensors in one process). Creates a fresh optimizer's state (see the module's
    docstring)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    if ema is not None:
        state["ema"] = get_model_state_dict(ema.module)
    return state


def _rng_path(folder: Path, rank: int, suffix: str) -> Path:
    return folder / RNG_NAME / f"rank-{rank:05d}.{suffix}"


def save_sharded_train_state(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                             ema: EMA | None, state: dict[str, Any], rank: int, world: int,
                             keep_last: int = 2) -> Path:
    """Write the training state at `step` to RUN/ckpt/step-XXXXXXX (module docstring); keep the newest
    `keep_last`. A collective: every process calls it."""
    import torch.distributed.checkpoint as dcp

    root = Path(run_dir) / "ckpt"
    final = root / step_dir_name(step)
    tmp_name = ""
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{final.name}-"))
        permit_as_created(tmp, directory=True)
        (tmp / RNG_NAME).mkdir()
        tmp_name = tmp.name
    tmp = root / distributed.broadcast_string(tmp_name)
    try:
        with _single_process_quiet():
            dcp.save(tensor_state(model, optimizer, ema), checkpoint_id=tmp / DCP_NAME, no_dist=world == 1)
        rng_tensors, rng_meta = capture_rng()
        save_safetensors(rng_tensors, _rng_path(tmp, rank, "safetensors"))
        _rng_path(tmp, rank, "json").write_text(json.dumps(rng_meta) + "\n")
        distributed.barrier()
        if rank == 0:
            meta = {**state, "step": step, "format": FORMAT, "processes": world, "torch": torch.__version__,
                    "has_ema": ema is not None}
            (tmp / STATE_NAME).write_text(json.dumps(meta) + "\n")
            put_in_place(tmp, final)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rank == 0:
        prune(root, keep_last)
    return final


def read_state(ckpt: Path) -> dict[str, Any]:
    """A sharded checkpoint's state.json; CheckpointError naming the file when it is missing or unreadable."""
    path = Path(ckpt) / STATE_NAME
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt}: not a training checkpoint (no {STATE_NAME})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def load_sharded_train_state(ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA | None,
                             rank: int, world: int) -> tuple[dict[str, Any], list[str]]:
    """Load a sharded checkpoint into `model`, `optimizer` and `ema` in place, and the generator states (see
    the module's docstring). Returns state.json and the notes a resumed run prints. A collective. Errors
    (CheckpointError) name the file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    ckpt = Path(ckpt)
    meta = read_state(ckpt)
    if meta.get("format") != FORMAT or not is_sharded_checkpoint(ckpt):
        raise CheckpointError(f"{ckpt}: not a sharded (parallel=fsdp) checkpoint")
    if ema is not None and not meta.get("has_ema"):
        raise CheckpointError(f"{ckpt}: no EMA in {DCP_NAME}/, though this run keeps an EMA of its weights")
    notes = []
    if meta.get("torch") != torch.__version__:
        notes.append(f"note: {ckpt.name} was written by torch {meta.get('torch')} and is read by torch "
                     f"{torch.__version__}: DCP files are not promised to load across versions")
    tensors = tensor_state(model, optimizer, ema)
    try:
        with _single_process_quiet():
            dcp.load(tensors, checkpoint_id=ckpt / DCP_NAME, no_dist=world == 1)
    except (Exception, CheckpointException) as e:  # DCP gathers every process's failure into one
        raise CheckpointError(f"{ckpt / DCP_NAME}: unreadable ({_last_line(e)})") from None
    set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=tensors["optim"])
    if ema is not None:
        set_model_state_dict(ema.module, tensors["ema"])
        ema.updates = meta["ema_updates"]
    if meta.get("processes", 1) == world:
        rng_file = _rng_path(ckpt, rank, "safetensors")
        try:
            restore_rng(load_file(str(rng_file)), json.loads(_rng_path(ckpt, rank, "json").read_text()))
        except Exception as e:
            raise CheckpointError(f"{rng_file}: unreadable ({e})") from None
    return meta, notes


def _last_line(error: BaseException, limit: int = 300) -> str:
    """The last line of an error's message, where DCP puts the reason under each process's traceback."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    return lines[-1][:limit]


def read_full_tensors(ckpt: Path) -> dict[str, Any]:
    """Every tensor of a sharded checkpoint, whole, in one process: {'model': {...}, 'optim': {...},
    ['ema': {...}]}, as `tensor_state` names them. For inspection and tests; a run resumes through
    `load_sharded_train_state`."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(Path(ckpt) / DCP_NAME, Path(tmp) / "state.pt")
        return torch.load(Path(tmp) / "state.pt", weights_only=True)
