"""Checkpoints of a training run, so that `--resume` continues exactly where a run stopped.

A run folder holds:

    RUN/config.json              the resolved TrainConfig
    RUN/ckpt/step-000400/        training state at step 400 (the last `keep_last` are kept):
        model/                   a vitkit checkpoint (model.safetensors + config.json): `vitkit.load` reads it
        optimizer.safetensors    the optimizer's tensors, keys "<param index>.<name>"
        ema.safetensors          the averaged weights (when EMA is on)
        rng.safetensors          torch's CPU (and CUDA) generator states
        state.json               step, epoch, position in the epoch, best metric, optimizer hyper-parameters,
                                 numpy's and Python's generator states
    RUN/best/, RUN/last/         vitkit checkpoints of the best (by validation top-1) and of the latest model

A run with `parallel=fsdp` writes sharded training-state checkpoints instead (dcp_checkpoints.py); its
best/ and last/ are the same plain vitkit checkpoints.

A checkpoint is written into a temporary folder and renamed into place when complete, so a run killed at any
moment leaves only complete checkpoints (and perhaps a `.tmp-*` or `.old-*` folder, ignored, and cleaned up by
the next run in the folder). Everything is safetensors or JSON: nothing is pickled. While a run writes the
folder it holds RUN/.lock, so that a second run into the same folder is refused.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from ..checkpoint import CheckpointError, save
from ..files import permit_as_created, save_safetensors

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_NAME = "state.json"


# --- optimizer state as tensors + JSON ----------------------------------------------------------------------
def optimizer_to_flat(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split `optimizer.state_dict()` into tensors (for safetensors) and JSON-able hyper-parameters."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{name}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_flat(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `optimizer_to_flat`: a state dict for `optimizer.load_state_dict`."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    for idx, values in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(values)
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups}


# --- random generator states --------------------------------------------------------------------------------
def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The states of torch's (CPU and CUDA), numpy's and Python's global generators."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.cuda.get_rng_state()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss_next = random.getstate()
    meta = {
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "python": {"version": version, "state": list(py_state), "gauss_next": gauss_next},
    }
    return tensors, meta


def restore_rng(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    n = meta["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = meta["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))


# --- writing and finding checkpoints ------------------------------------------------------------------------
def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def step_of(ckpt: Path) -> int:
    """The step a checkpoint folder (RUN/ckpt/step-XXXXXXX) was written at: step_dir_name's inverse."""
    return int(STEP_DIR.match(Path(ckpt).name).group(1))


def save_train_state(
    run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    state: dict[str, Any], class_names: list[str] | None = None,
    ema_state: dict[str, torch.Tensor] | None = None, keep_last: int = 2,
) -> Path:
    """Write the training state at `step` to RUN/ckpt/step-XXXXXXX atomically; keep the newest `keep_last`."""
    root = Path(run_dir) / "ckpt"
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{final.name}-"))
    permit_as_created(tmp, directory=True)
    try:
        save(model, tmp / "model", class_names=class_names)
        opt_tensors, opt_meta = optimizer_to_flat(optimizer)
        save_safetensors(opt_tensors, tmp / "optimizer.safetensors")
        if ema_state is not None:
            save_safetensors({k: v.detach().to("cpu").contiguous() for k, v in ema_state.items()},
                             tmp / "ema.safetensors")
        rng_tensors, rng_meta = capture_rng()
        save_safetensors(rng_tensors, tmp / "rng.safetensors")
        meta = {**state, "step": step, "optimizer": opt_meta, "rng": rng_meta}
        (tmp / STATE_NAME).write_text(json.dumps(meta) + "\n")
        put_in_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(root, keep_last)
    return final


def put_in_place(tmp: Path, final: Path) -> None:
    """Make the complete checkpoint written into `tmp` the checkpoint `final`: flushed to disk first, then
    renamed into place (replacing `final` where the same step is written again, e.g. at the end of a resumed
    run), so that a kill at any moment leaves either the old checkpoint or the new one."""
    fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def fsync_tree(folder: Path) -> None:
    """Flush every file in `folder` to disk, so that the rename publishes complete files."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete training-state checkpoints of a run, oldest first."""
    root = Path(run_dir) / "ckpt"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_DIR.match(p.name)) and (p / STATE_NAME).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def prune(root: Path, keep_last: int) -> None:
    """Remove all but the newest `keep_last` checkpoints, and leftovers of interrupted writes."""
    found = list_checkpoints(root.parent)
    for old in found[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    remove_unfinished_writes(root)


def remove_unfinished_writes(folder: Path) -> None:
    """Remove the `.tmp-*` and `.old-*` folders that writes interrupted in `folder` leave (save_train_state's,
    save_model_atomically's)."""
    for leftover in [*folder.glob(".tmp-*"), *folder.glob(".old-*")]:
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)


def load_train_state(ckpt: Path) -> dict[str, Any]:
    """Read a training-state checkpoint: {'state': state.json, 'model': tensors, 'optimizer': state dict,
    'ema': tensors or None, 'rng': (tensors, meta)}. Errors name the file."""
    ckpt = Path(ckpt)
    state_path = ckpt / STATE_NAME
    try:
        meta = json.loads(state_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt}: not a training checkpoint (no {STATE_NAME})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{state_path}: not valid JSON ({e})") from None

    def read(name: str) -> dict[str, torch.Tensor]:
        try:
            return load_file(str(ckpt / name))
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{ckpt / name}: unreadable ({e})") from None

    return {
        "state": meta,
        "model": read("model/model.safetensors"),
        "optimizer": optimizer_from_flat(read("optimizer.safetensors"), meta["optimizer"]),
        "ema": read("ema.safetensors") if (ckpt / "ema.safetensors").is_file() else None,
        "rng": (read("rng.safetensors"), meta["rng"]),
    }


def save_model_atomically(model: torch.nn.Module, folder: Path, class_names: list[str] | None,
                          extra: dict[str, Any] | None = None) -> Path:
    """`vitkit.save` into a temporary folder, then swap it in for `folder` (RUN/best, RUN/last)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".tmp-{folder.name}-"))
    permit_as_created(tmp, directory=True)
    try:
        save(model, tmp, class_names=class_names, extra=extra)
        fsync_tree(tmp)
        old = None
        if folder.exists():
            old = folder.with_name(f".old-{folder.name}-{os.getpid()}")
            os.replace(folder, old)
        os.replace(tmp, folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


# --- one run per folder ------------------------------------------------------------------------------------
LOCK_NAME = ".lock"


class RunFolderBusy(ValueError):
    """Another run holds the run folder."""


class RunFolderLock:
    """An exclusive lock on a run folder while a run writes it (flock on RUN/.lock, which holds the owner's
    process id): a second run into the same folder, e.g. a job started twice or requeued while it still
    runs, is refused instead of interleaving its checkpoints and logs with the first's. The kernel releases
    the lock when the process ends, however it ends, so a killed run leaves no stale lock behind."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self.fd: int | None = None

    def __enter__(self) -> RunFolderLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunFolderBusy(f"{self.path.parent} is in use by another run (process {holder}); wait for "
                                "it to end, or choose another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None


def clean_leftovers(run_dir: Path) -> None:
    """Tidy what a killed run may leave, once the lock is held: `best/` or `last/` that a kill between the two
    renames of save_model_atomically left moved aside as `.old-*` comes back, and the `.tmp-*` and `.old-*`
    folders of unfinished writes go."""
    run_dir = Path(run_dir)
    for name in ("best", "last"):
        aside = sorted(run_dir.glob(f".old-{name}-*"), key=lambda p: p.stat().st_mtime)
        if aside and not (run_dir / name).exists():
            os.replace(aside[-1], run_dir / name)
    for folder in (run_dir, run_dir / "ckpt"):
        remove_unfinished_writes(folder)
