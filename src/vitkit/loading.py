"""`vitkit.load`: any public ViT checkpoint, by path or hub name, as a vitkit model.

Accepted: vitkit checkpoint folders; Google .npz files (vision_transformer and big_vision naming, scan
files, the R50 hybrid); timm state dicts and hub folders (.safetensors, or .pth/.bin read with
`torch.load(weights_only=True)`); Hugging Face ViTModel / ViTForImageClassification folders; torchvision
`vit_*` state dicts; and hub names ("hf-hub:google/vit-base-patch16-224",
"vit_base_patch16_224.augreg2_in21k_ft_in1k"), fetched into the Hugging Face cache.

The architecture is read from the tensors: widths, depth, patch, MLP size and classes from shapes, the
heads from the npz query kernel or from config.json. timm and torchvision fuse q;k;v, so their heads
cannot be read from shapes: they come from config.json (timm's model_args, the architecture's preset, or
timm's builder of the architecture), else the preset whose width matches (Table 1, DeiT), else 64-wide heads.
The image size comes from the position table (a non-square grid needs `image_size=` or a config), and a timm
or vitkit model with a class token may pool by it or by GAP (`pool=`). Whatever a bare file leaves open and
vitkit assumes (heads, a square grid, token pooling) is a UserWarning that names the argument that sets it.
What differs between sources is recorded in the config: tanh GELU for Google's Flax models, LayerNorm eps
(1e-12 for Hugging Face files without a config), normalisation mean/std (0.5 for Google and timm's ViTs,
ImageNet's for torchvision). A sharded folder's index must agree with its shards: each tensor it names held
by exactly one of them.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import torch

from .checkpoint import CheckpointError, load_vitkit, read_meta, read_tensors
from .config import POOLS, ViTConfig
from .convert.common import Converted, Hints, build_model
from .convert.detect import (
    EXTENSIONS,
    NPZ,
    SAFETENSORS,
    TORCH,
    check_extension,
    check_shards,
    folder_format,
    read_json,
    shard_index,
    sniff_file,
    state_format,
    weight_files,
)
from .model import VisionTransformer

WRAPPER_KEYS = ("state_dict", "model", "model_state", "module", "state_dict_ema")


def load(path_or_name: str | os.PathLike, map_location: str | torch.device = "cpu",
         image_size: int | tuple[int, int] | None = None, num_heads: int | None = None,
         pool: str | None = None) -> VisionTransformer:
    """The model a checkpoint or hub name holds, in eval mode, with `model.class_names` (list or None).

    `image_size`, `num_heads` and `pool` are needed only where the file cannot tell them: a bare state dict
    (no config) whose grid is not square, whose fused q;k;v heads are not the ones its width suggests, or
    whose model has a class token but pools by averaging the patch tokens (`pool="gap"`). Where vitkit has
    to assume one of them, it says so in a UserWarning that names the argument; an argument given wins over
    the file's config. vitkit's own folders hold their whole config and ignore them.
    """
    device = torch.device(map_location)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"map_location={str(map_location)!r}: torch finds no CUDA device on this machine; "
                         "load to 'cpu'")
    hints = _hints(num_heads, pool)
    p = _resolve(path_or_name, hints)
    if p.is_dir() and folder_format(p)[0] == "vitkit":  # the native format's own loader and its checks
        return load_vitkit(p, map_location)
    return build_model(_read_path(p, _size_hint(hints, image_size)), map_location)



def _hints(num_heads: int | None, pool: str | None) -> Hints:
    if pool is not None and pool not in POOLS:
        raise ValueError(f"pool={pool!r}: choose from {', '.join(POOLS)}")
    return Hints(num_heads=num_heads, pool=pool)


def _size_hint(hints: Hints, image_size: int | tuple[int, int] | None) -> Hints:
    if image_size is not None:
        hints.image_size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    return hints


def _resolve(path_or_name: str | os.PathLike, hints: Hints) -> Path:
    """The local file or folder of a path or hub name (fetched into the hub cache if need be)."""
    from . import hub

    p = Path(path_or_name)
    text = os.fspath(path_or_name)  # a CLI may hand over a hub name as a Path
    if not p.exists() and hub.is_hub_name(text):
        try:
            p = hub.fetch(text)
            hints.name = hub.display_name(text)
        except CheckpointError as e:
            if text.startswith(hub.PREFIX):
                raise
            # "checkpoint" or "vit_small.bad_tag" may be meant as a local path just as well as a hub name.
            reason = str(e).removeprefix(f"{text}: ")
            raise CheckpointError(f"{text}: no such file or folder, and as a hub name: {reason}") from None
    if not p.exists():
        hint = " (hub names look like 'hf-hub:org/repo' or 'vit_base_patch16_224.augreg2_in21k_ft_in1k')" \
            if "/" in str(path_or_name) and not str(path_or_name).startswith((".", "/")) else ""
        raise CheckpointError(f"{path_or_name}: no such file or folder{hint}")
    if (p.is_file() and p.name in ("model.safetensors", "pytorch_model.bin")
            and (p.parent / "config.json").is_file()):
        p = p.parent  # the weights of a model folder: read with the folder's config
    return p


def _read_path(p: Path, hints: Hints) -> Converted:
    if p.is_dir():
        return _read_folder(p, hints)
    hints.name = hints.name or (p.stem if p.suffix.lower() in EXTENSIONS else p.name)
    return _convert_state(_read_file(p), hints, str(p))


def _read_folder(folder: Path, hints: Hints) -> Converted:
    fmt, config = folder_format(folder)
    source = str(folder)
    if fmt == "vitkit":
        meta = read_meta(folder)
        try:
            cfg = ViTConfig.from_dict(meta["model"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{folder / 'config.json'}: bad model config ({e})") from None
        weights = folder / "model.safetensors"
        return Converted(cfg, read_tensors(weights), meta.get("class_names"), str(weights), "vitkit")
    shards = {f: _read_file(f) for f in weight_files(folder)}
    index = shard_index(folder)
    if index is not None:
        check_shards(index, {f.name: set(tensors) for f, tensors in shards.items()})
    state: dict[str, torch.Tensor] = {}
    for tensors in shards.values():
        state.update(tensors)
    if fmt == "timm":
        from .convert.timm import from_timm, hints_from_config, unwrap_timm_wrapper

        return from_timm(unwrap_timm_wrapper(state, config), _merge(hints_from_config(config, source), hints),
                         source)
    if fmt == "hf":
        from .convert.hf import from_hf, hints_from_config

        pre = folder / "preprocessor_config.json"
        return from_hf(state, _merge(hints_from_config(config, read_json(pre) if pre.is_file() else None,
                                                       source), hints), source)
    hints.name = hints.name or folder.name
    return _convert_state(state, hints, source)


def _merge(from_file: Hints, from_caller: Hints) -> Hints:
    """The caller's explicit image size, heads and pooling win over the file's; the hub name over config's
    name."""
    if from_caller.image_size:
        from_file.image_size = from_caller.image_size
    if from_caller.num_heads:
        from_file.num_heads = from_caller.num_heads
    if from_caller.pool:
        from_file.pool = from_caller.pool
    if from_caller.name:
        from_file.name = from_caller.name
    return from_file


def _convert_state(state, hints: Hints, source: str) -> Converted:
    """A bare state dict (or .npz arrays), whose names say its format."""
    if isinstance(state, _NpzArrays):
        from .convert.npz import from_npz

        return from_npz(state.arrays, hints, source)
    try:
        fmt = state_format(set(state))
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from None
    if fmt == "timm":
        from .convert.timm import from_timm

        return from_timm(state, hints, source)
    if fmt == "hf":
        from .convert.hf import from_hf

        return from_hf(state, hints, source)
    from .convert.torchvision import from_torchvision

    return from_torchvision(state, hints, source)


class _NpzArrays:
    """The arrays of an .npz file, kept apart from PyTorch state dicts (their names need their own rules)."""

    def __init__(self, arrays):
        self.arrays = arrays


def _read_file(path: Path):
    """The tensors of one file, by its content; refuses pickles that would run code."""
    kind = sniff_file(path)
    check_extension(path, kind)
    if kind == SAFETENSORS:
        return read_tensors(path)
    if kind == NPZ:
        from .convert.npz import read_npz

        return _NpzArrays(read_npz(path))
    assert kind == TORCH
    return unwrap_state_dict(torch_load(path), str(path))


def torch_load(path: Path):
    """torch.load with weights_only=True: tensors and plain containers only, never code."""
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused: this pickle holds more than tensors and would run code when unpickled "
            f"({_refusal_reason(e)}). vitkit reads only state dicts of tensors; re-save with "
            "torch.save(model.state_dict(), ...) or safetensors") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable PyTorch file "
                              f"({str(e).splitlines()[0] if str(e) else e})") from None


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _refusal_reason(e: Exception) -> str:
    """What torch's weights-only unpickler refused, in one line: the global the pickle would import
    (torch names it "GLOBAL module.name"), else torch's own reason without its advice, ANSI codes or
    newlines."""
    text = _ANSI.sub("", str(e))
    found = re.search(r"GLOBAL (\S+)", text)
    if found:
        return f"it imports {found.group(1)}, which torch.load(weights_only=True) does not allow"
    reason = text.rpartition("WeightsUnpickler error:")[2] if "WeightsUnpickler error:" in text else text
    lines = [line.strip() for line in reason.splitlines()]
    advice = ("Weights only load failed", "Check the documentation")
    kept = [line for line in lines if line and not line.startswith(advice)]
    return " ".join(kept) or type(e).__name__


def unwrap_state_dict(obj, source: str) -> dict[str, torch.Tensor]:
    """The state dict inside what torch.load returned: the object itself, or the entry of a training
    checkpoint that holds it ("state_dict", "model", ...). A DDP "module." prefix on every key is removed."""
    if not isinstance(obj, dict):
        raise CheckpointError(f"{source}: holds a {type(obj).__name__}, not a state dict")
    if not all(isinstance(v, torch.Tensor) for v in obj.values()):
        for key in WRAPPER_KEYS:
            inner = obj.get(key)
            if isinstance(inner, dict) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                obj = inner
                break
        else:
            raise CheckpointError(f"{source}: a dict whose entries are not all tensors and that has no "
                                  f"state dict under {list(WRAPPER_KEYS)} (keys {sorted(obj)[:10]})")
    if obj and all(k.startswith("module.") for k in obj):
        obj = {k[len("module."):]: v for k, v in obj.items()}
    return dict(obj)

