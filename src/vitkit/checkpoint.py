"""vitkit's own checkpoint format (vitkit.folder_format) for VisionTransformer: `save` and `load_vitkit`,
with the checks that need the model class."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .config import ViTConfig
from .folder_format import (  # noqa: F401  (re-exported: the format's names, where callers look for them)
    CONFIG_NAME,
    FORMAT,
    FORMAT_VERSION,
    OPTIMIZED,
    WEIGHTS_NAME,
    CheckpointError,
    check_state_dict,
    load_folder,
    model_from_state,
    preprocessing,
    read_meta,
    read_tensors,
    write_folder,
)
from .model import VisionTransformer


def save(model: VisionTransformer, path: str | os.PathLike, class_names: list[str] | None = None,
         extra: dict[str, Any] | None = None) -> Path:
    """Write `model` to the folder `path` (created if needed). Returns the folder.

    The model must be a VisionTransformer whose tensors fit its config, so that every folder written loads
    again: a torch.compile'd model is saved as the model it wraps, the output of `vitkit.optimize` is refused
    (save the model that went in)."""
    optimized = getattr(model, OPTIMIZED, None)
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the same tensors
    if optimized is not None:
        raise ValueError(f"this model comes from vitkit.optimize(precision={optimized!r}), which made its "
                         "layers into inference-only ones for this machine (packed, quantised or compiled): "
                         "save the model you passed to vitkit.optimize")
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ViTConfig):
        raise TypeError(f"vitkit.save takes a vitkit VisionTransformer, got {type(model).__name__}")
    if class_names is not None and len(class_names) != cfg.num_classes:
        raise ValueError(f"{len(class_names)} class names for a model with {cfg.num_classes} classes")
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    with torch.device("meta"):  # the same check load runs, before anything is written
        check_state_dict(VisionTransformer(cfg), state, f"the model to save to {path}")
    return write_folder(path, cfg, state, class_names, extra)


def load_vitkit(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> VisionTransformer:
    """Rebuild the model saved by `save` from its folder (or its model.safetensors file), in eval mode."""
    return load_folder(VisionTransformer, path).to(map_location).eval()
