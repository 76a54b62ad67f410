"""vitkit's folder format, below the model: a folder with `model.safetensors` (the tensors) and `config.json`
(the model config, class names, preprocessing and, from a training run, its record). Reading, checking and
writing it need only the config and the tensors, so that the model's own Hub methods (vitkit.hub_mixin) and
vitkit.checkpoint share them. Data, never a program: nothing here unpickles."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, TypeVar

import torch

from .config import ViTConfig
from .files import write_model_folder
from .posemb import sincos_position_table
from .tensor_reader import read_safetensors

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
FORMAT = "vitkit"
FORMAT_VERSION = 1
# The attribute vitkit.optimize sets on the inference-only copies it makes (which no folder can hold).
OPTIMIZED = "vitkit_optimized"
M = TypeVar("M", bound=torch.nn.Module)


class CheckpointError(ValueError):
    """A file or folder that is not a usable checkpoint; the message names it and says why."""


def preprocessing(cfg: ViTConfig) -> dict[str, Any]:
    """What an image must go through before the model sees it."""
    return {
        "input_size": [cfg.in_chans, *cfg.image_size],
        "mean": list(cfg.mean),
        "std": list(cfg.std),
        "interpolation": cfg.interpolation,
        "crop_pct": cfg.crop_pct,
        "crop_mode": cfg.crop_mode,
    }


def save_model(model: torch.nn.Module, model_cls: type[M], path: str | os.PathLike,
               class_names: list[str] | None = None, extra: dict[str, Any] | None = None,
               verb: str = "save") -> Path:
    """Write `model` (a `model_cls`, VisionTransformer: its `cfg` and state dict) as a vitkit folder, after
    the check loading runs against `model_cls(cfg)`, so that every folder written loads again; the output of
    vitkit.optimize is refused ("`verb` the model you passed to vitkit.optimize"). Returns the folder."""
    optimized = getattr(model, OPTIMIZED, None)
    if optimized is not None:
        raise ValueError(f"this model comes from vitkit.optimize(precision={optimized!r}), which made its "
                         "layers into inference-only ones for this machine (packed, quantised or compiled): "
                         f"{verb} the model you passed to vitkit.optimize")
    cfg = model.cfg
    if class_names is not None and len(class_names) != cfg.num_classes:  # before the state is copied
        raise ValueError(f"{len(class_names)} class names for a model with {cfg.num_classes} classes")
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    with torch.device("meta"):  # the same check load runs, before anything is written
        check_state_dict(model_cls(cfg), state, f"the model to save to {path}")
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": cfg.to_dict(),
        "class_names": list(class_names) if class_names is not None else None,
        "preprocessing": preprocessing(cfg),
    }
    if extra:
        meta.update(extra)
    return write_model_folder(path, state, FORMAT, {CONFIG_NAME: meta})


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed config.json of a vitkit checkpoint folder, with a clear error for anything else."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder")
    folder = p if p.is_dir() else p.parent
    cfg_path = folder / CONFIG_NAME
    if not cfg_path.is_file():
        raise CheckpointError(f"{folder}: not a vitkit checkpoint (no {CONFIG_NAME})")
    try:
        meta = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{cfg_path}: not a vitkit checkpoint config (no \"format\": \"{FORMAT}\")")
    return meta


def read_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file, with the file named in any error (truncated, corrupt, missing)."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p}: no such file")
    try:
        return read_safetensors(p)  # into aligned memory, the file's size at the peak (tensor_reader.py)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{p}: not a readable safetensors file ({e})") from None


def read_folder(path: str | os.PathLike) -> tuple[ViTConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """The config, the tensors and the parsed config.json of a vitkit folder (or of its model.safetensors),
    with the class names checked against the config."""
    p = Path(path)
    meta = read_meta(p)  # first, so that a missing path is named as given, not as its parent folder
    folder = p if p.is_dir() else p.parent
    try:
        cfg = ViTConfig.from_dict(meta["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{folder / CONFIG_NAME}: bad model config ({e})") from None
    names = meta.get("class_names")
    if names is not None and (not isinstance(names, list) or len(names) != cfg.num_classes):
        count = f"{len(names)} class names" if isinstance(names, list) else f"class_names {names!r}"
        raise CheckpointError(f"{folder / CONFIG_NAME}: {count} for a model with {cfg.num_classes} classes "
                              "(class_names must be a list with one name per class, or null)")
    return cfg, read_tensors(folder / WEIGHTS_NAME), meta


def load_folder(model_cls: type[M], path: str | os.PathLike) -> M:
    """The `model_cls` (VisionTransformer) a vitkit folder holds, checked, with `class_names` and
    `train_record` set from its config.json; on the CPU, in training mode as built."""
    cfg, state, meta = read_folder(path)
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    with torch.device("meta"):  # shapes only, nothing allocated: check before anything is loaded
        check_state_dict(model_cls(cfg), state, str(folder / WEIGHTS_NAME))
    model = model_from_state(model_cls, cfg, state)  # the file's tensors, no random initialisation first
    names = meta.get("class_names")
    model.class_names = [str(n) for n in names] if names is not None else None
    model.train_record = meta.get("train")  # a training run's record, for save_pretrained's model card
    return model


def check_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Raise, naming every missing, unexpected and misshapen key, unless `state` fits `model` exactly."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshapen = sorted(
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(expected) & set(state)
        if tuple(state[k].shape) != tuple(expected[k].shape)
    )
    if missing or unexpected or misshapen:
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected}")
        if misshapen:
            parts.append(f"misshapen {misshapen}")
        raise CheckpointError(f"{source}: tensors do not fit the config: " + "; ".join(parts))


ALIGNMENT = 64  # bytes: PyTorch's CPU allocator's, which the kernels expect


def model_from_state(model_cls: type[M], cfg: ViTConfig, state: dict[str, torch.Tensor]) -> M:
    """The `model_cls` (VisionTransformer) of `cfg` holding `state`'s tensors (they must fit it:
    check_state_dict): built on the meta device, so nothing is allocated or randomly initialised only to be
    overwritten, then given the tensors (load_state_dict with assign=True) and its fixed sin-cos table, which
    no state dict holds.

    A tensor is taken as it is where it owns its memory at PyTorch's 64-byte alignment; one that shares its
    memory (views of one array: safetensors refuses to save those) or lies at a lesser alignment (a file's
    tensors: the kernels would run other code paths, slower and not bit for bit the same) is copied, one at a
    time in place in `state`, so that at most one extra tensor is held at once."""
    users = Counter(t.untyped_storage().data_ptr() for t in state.values())
    for k, v in state.items():
        if users[v.untyped_storage().data_ptr()] > 1 or v.data_ptr() % ALIGNMENT or not v.is_contiguous():
            state[k] = torch.empty_like(v, memory_format=torch.contiguous_format).copy_(v)
            del v
    with torch.device("meta"):
        model = model_cls(cfg)
    model.load_state_dict(state, assign=True)
    if cfg.pos_embed == "sincos-2d":
        table = sincos_position_table(cfg.grid_size, cfg.dim, cfg.num_prefix_tokens)
        model.pos_embed_fixed = table.to(next(iter(state.values())).device)
    return model
