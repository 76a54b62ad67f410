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
    save_model,
)
from .model import VisionTransformer


def save(model: VisionTransformer, path: str | os.PathLike, class_names: list[str] | None = None,
         extra: dict[str, Any] | None = None) -> Path:
    """Write `model` to the folder `path` (created if needed). Returns the folder.

    The model must be a VisionTransformer whose tensors fit its config, so that every folder written loads
    again: a torch.compile'd model is saved as the model it wraps, the output of `vitkit.optimize` is refused
    (save the model that went in)."""
    if getattr(model, OPTIMIZED, None) is None:  # (an optimized model is refused by save_model)
        model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the same tensors
        if not isinstance(getattr(model, "cfg", None), ViTConfig):
            raise TypeError(f"vitkit.save takes a vitkit VisionTransformer, got {type(model).__name__}")
    return save_model(model, VisionTransformer, path, class_names, extra)


def load_vitkit(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> VisionTransformer:
    """Rebuild the model saved by `save` from its folder (or its model.safetensors file), in eval mode."""
    return load_folder(VisionTransformer, path).to(map_location).eval()
