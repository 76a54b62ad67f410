"""Every public ViT checkpoint format, to and from vitkit's.

Readers (each a thin, asserted mapping onto vitkit's parameter names, which are timm's):
- `npz`: Google's Flax .npz files, vision_transformer and big_vision naming (scan files, the R50 hybrid);
- `timm`: timm state dicts and hub folders (identity names; the hybrids included);
- `hf`: transformers' ViTModel / ViTForImageClassification folders;
- `torchvision`: torchvision's vit_* state dicts.
`detect` tells a path's format from its content; `vitkit.loading.load` puts it all together.

Writers: `write(model, dst, to="vitkit" | "timm" | "hf")`.
"""

from __future__ import annotations

from pathlib import Path

from ..model import VisionTransformer

TARGETS = ("vitkit", "timm", "hf")


def write(model: VisionTransformer, dst: str | Path, to: str = "vitkit",
          class_names: list[str] | None = None) -> Path:
    """Write `model` as a vitkit checkpoint, a timm hub folder or a Hugging Face transformers folder."""
    if to == "vitkit":
        from ..checkpoint import save

        return save(model, dst, class_names=class_names)
    if to == "timm":
        from .timm import write_timm

        return write_timm(model, dst, class_names)
    if to == "hf":
        from .hf import write_hf

        return write_hf(model, dst, class_names)
    raise ValueError(f"unknown target format {to!r}; choose from {', '.join(TARGETS)}")


__all__ = ["TARGETS", "write"]
