"""What a path holds, read from its content, not trusted from its name.

Files: safetensors (an 8-byte little-endian header length, then a JSON header), .npz (a zip of `.npy`
members), PyTorch (a zip with a `data.pkl` member, or a legacy pickle stream). A file whose content
contradicts its extension is refused. Folders: `config.json` says whose format it is (vitkit:
"format": "vitkit"; timm: "architecture"; Hugging Face: "model_type"). Tensor names say the rest.
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointError

SAFETENSORS, NPZ, TORCH = "safetensors", "npz", "torch"
EXTENSIONS = {".safetensors": SAFETENSORS, ".npz": NPZ, ".pth": TORCH, ".pt": TORCH, ".bin": TORCH,
              ".ckpt": TORCH}
# Weight files of a model folder, in the order they are preferred, then the indexes of sharded ones
# (transformers' save_pretrained with max_shard_size: model-00001-of-00002.safetensors, or
# pytorch_model-00001-of-00002.bin from older versions and safe_serialization=False).
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def sniff_file(path: str | Path) -> str:
    """SAFETENSORS, NPZ or TORCH from the first bytes of the file; a CheckpointError for anything else."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            head = f.read(16)
        size = p.stat().st_size
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e.strerror or e})") from None
    if head[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(p) as z:
                names = z.namelist()
        except zipfile.BadZipFile as e:
            raise CheckpointError(f"{p}: a damaged zip file ({e})") from None
        if names and all(n.endswith(".npy") for n in names):
            return NPZ
        if any(n.endswith("data.pkl") for n in names):
            return TORCH
        raise CheckpointError(f"{p}: a zip file that is neither an .npz nor a PyTorch file "
                              f"(members {names[:5]})")
    if len(head) >= 9:
        (header_len,) = struct.unpack("<Q", head[:8])
        if 8 + header_len <= size and head[8:9] == b"{":
            return SAFETENSORS
    if head[:1] == b"\x80":  # a pickle stream (PROTO opcode): torch.save's legacy format
        return TORCH
    raise CheckpointError(f"{p}: not a vitkit checkpoint, nor a checkpoint file vitkit knows (safetensors, "
                          f".npz, PyTorch); it starts with {head[:8]!r}")


def check_extension(path: Path, kind: str) -> None:
    """Refuse a file whose name claims another format than its content."""
    claimed = EXTENSIONS.get(path.suffix.lower())
    if claimed is not None and claimed != kind:
        raise CheckpointError(f"{path}: named {path.suffix} (a {claimed} file) but its content is a {kind} "
                              "file; rename it or check where it came from")


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def folder_format(folder: Path) -> tuple[str, dict[str, Any]]:
    """("vitkit" | "timm" | "hf" | "weights", config) for a model folder."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        if weight_files(folder, required=False):
            return "weights", {}
        raise CheckpointError(f"{folder}: not a vitkit checkpoint (no config.json), nor a timm or Hugging "
                              f"Face folder, nor a folder of weights ({', '.join(WEIGHT_FILES)})")
    config = read_json(cfg_path)
    if config.get("format") == "vitkit":
        return "vitkit", config
    fmt = "timm" if "architecture" in config else "hf" if "model_type" in config else None
    if fmt is None and ((folder / "ckpt").is_dir() or "recipe" in config):
        models = [str(folder / name) for name in ("last", "best") if (folder / name).is_dir()]
        raise CheckpointError(f"{folder}: a training run folder, not a checkpoint; its models are "
                              + (" and ".join(models) if models else "not written yet (see its ckpt/)"))
    if fmt is None:
        raise CheckpointError(f"{cfg_path}: not a vitkit checkpoint config, nor a timm or Hugging Face one "
                              "(no \"format\", \"architecture\" or \"model_type\")")
    if not weight_files(folder, required=False):
        name = "timm" if fmt == "timm" else "Hugging Face"
        raise CheckpointError(f"{cfg_path}: not a vitkit checkpoint config but a {name} one, and {folder} "
                              f"holds no weights ({', '.join(WEIGHT_FILES)} or {' / '.join(SHARD_INDEXES)})")
    return fmt, config


def weight_files(folder: Path, required: bool = True) -> list[Path]:
    """The weight file(s) of a folder: the first of WEIGHT_FILES, or every shard the first of SHARD_INDEXES
    lists (each read as its content says, .bin shards through the same safe torch.load as a .bin file)."""
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return [folder / name]
    for name in SHARD_INDEXES:
        if (folder / name).is_file():
            shards = shard_names(folder / name)
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise CheckpointError(f"{folder}: shards listed in {name} are missing: {missing}")
            return [folder / s for s in shards]
    if required:
        raise CheckpointError(f"{folder}: no weights ({', '.join(WEIGHT_FILES)} or "
                              f"{' / '.join(SHARD_INDEXES)})")
    return []


def shard_index(folder: Path) -> Path | None:
    """The shard index whose shards `weight_files` reads for this folder (None when it reads one file)."""
    if any((folder / name).is_file() for name in WEIGHT_FILES):
        return None
    return next((folder / name for name in SHARD_INDEXES if (folder / name).is_file()), None)


def read_weight_map(index: Path) -> dict[str, str]:
    """A shard index's weight_map: tensor name -> the shard file that holds it."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no \"weight_map\" from tensor names to shard files")
    return {str(k): str(v) for k, v in weight_map.items()}


def check_shards(index: Path, held: dict[str, set[str]]) -> None:
    """That the shards (`held`: shard file name -> the tensor names it holds) hold what the index says: a
    tensor the index names that no shard holds would be missing from the model, one that two shards hold is
    ambiguous (which is the model's?); both are listed in one error naming the index."""
    holders: dict[str, list[str]] = {}
    for shard, names in sorted(held.items()):
        for name in names:
            holders.setdefault(name, []).append(shard)
    absent = sorted(k for k in read_weight_map(index) if k not in holders)
    twice = {k: v for k, v in sorted(holders.items()) if len(v) > 1}
    problems = []
    if absent:
        problems.append(f"tensors it names that no shard holds {_few(absent)}")
    if twice:
        problems.append("tensors more than one shard holds: " + "; ".join(
            f"{k} (in {', '.join(v)})"
            for k, v in list(twice.items())[:10]) + ("; ..." if len(twice) > 10 else ""))
    if problems:
        raise CheckpointError(f"{index}: " + "; ".join(problems))


def _few(items: list[str], limit: int = 10) -> str:
    return str(items) if len(items) <= limit else f"{items[:limit]} and {len(items) - limit} more"


def shard_names(index: Path) -> list[str]:
    """The shard files a shard index's weight_map names, each checked to be a plain name (a file next to the
    index, never a path that leads elsewhere)."""
    shards = sorted(set(read_weight_map(index).values()))
    elsewhere = [s for s in shards if Path(s).name != s or s in (".", "..")]
    if elsewhere:
        raise CheckpointError(f"{index}: shards must be files next to the index, not {elsewhere}")
    return shards


def state_format(keys: set[str]) -> str:
    """Whose names a state dict uses: "timm" (also vitkit's), "hf" or "torchvision"."""
    from .hf import is_hf_state
    from .timm import is_timm_state
    from .torchvision import is_torchvision_state

    if is_timm_state(keys):
        return "timm"
    if is_hf_state(keys):
        return "hf"
    if is_torchvision_state(keys):
        return "torchvision"
    sample = sorted(keys)[:8]
    raise CheckpointError("not a ViT state dict vitkit recognises (timm, Hugging Face or torchvision "
                          f"names); its first keys are {sample}")
