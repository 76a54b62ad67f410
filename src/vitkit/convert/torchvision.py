"""torchvision's `vit_b_16`, `vit_b_32`, `vit_l_16`, `vit_l_32`, `vit_h_14` state dicts: a rename of timm's
names (torchvision's `in_proj_weight` is already the fused q;k;v, rows q first).

torchvision files carry no config. torchvision's ViT has only square images and pools by its class token, so
the image size (from the position table) and the pooling are known; the heads come from a `vit_*` name (the
paper's model it names), else they are guessed from the width (Table 1, 64-wide heads) with a warning that
says so (`vitkit.load(path, num_heads=...)` sets them). The preprocessing is torchvision's: ImageNet mean/std,
and for a position table of 224 px (or less) its ImageNet recipe (bilinear resize to 256, then a 224 centre
crop), for a larger one the SWAG weights' (vit_b_16 at 384 px, vit_l_16 at 512, vit_h_14 at 518: a bicubic
resize to the full size, no crop). SWAG's linear-probe weights (224 px, bicubic, no crop) cannot be told apart
from the ImageNet recipe's by their shapes: they get the latter.
"""

from __future__ import annotations

import torch

from ..checkpoint import CheckpointError
from ..config import get_preset
from .common import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Converted,
    Hints,
    default_class_names,
    infer_config,
    rename,
    warn_assumed_heads,
)

_LAYER = r"encoder\.layers\.encoder_layer_(\d+)\."
RULES = [
    (r"class_token", "cls_token"),
    (r"conv_proj\.(weight|bias)", r"patch_embed.proj.\1"),
    (r"encoder\.pos_embedding", "pos_embed"),
    (_LAYER + r"ln_1\.(weight|bias)", r"blocks.\1.norm1.\2"),
    (_LAYER + r"self_attention\.in_proj_(weight|bias)", r"blocks.\1.attn.qkv.\2"),
    (_LAYER + r"self_attention\.out_proj\.(weight|bias)", r"blocks.\1.attn.proj.\2"),
    (_LAYER + r"ln_2\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (_LAYER + r"mlp\.(?:0|linear_1)\.(weight|bias)", r"blocks.\1.mlp.fc1.\2"),  # linear_1: torchvision < 0.13
    (_LAYER + r"mlp\.(?:3|linear_2)\.(weight|bias)", r"blocks.\1.mlp.fc2.\2"),
    (r"encoder\.ln\.(weight|bias)", r"norm.\1"),
    (r"heads\.pre_logits\.(weight|bias)", r"pre_logits.\1"),
    (r"heads\.head\.(weight|bias)", r"head.\1"),
]

# torchvision's names for the paper's models (its weights' `meta` and builders).
NAMES = {"vit_b_16": "ViT-B/16", "vit_b_32": "ViT-B/32", "vit_l_16": "ViT-L/16", "vit_l_32": "ViT-L/32",
         "vit_h_14": "ViT-H/14"}


def is_torchvision_state(keys: set[str]) -> bool:
    return "conv_proj.weight" in keys and "encoder.pos_embedding" in keys


def torchvision_hints(hints: Hints, dim: int | None = None, source: str = "") -> Hints:
    """torchvision's mean, std and LayerNorm eps; the heads of the paper's model a `vit_*` name names (a
    guess, warned of, when the file's width `dim` is not that model's; an error when they do not divide
    it)."""
    for tv, paper in NAMES.items():
        if tv in hints.name and hints.num_heads is None:
            preset = get_preset(paper).config
            if dim is not None and dim % preset.num_heads:
                raise CheckpointError(f"{source}: its width {dim} is not divisible by {preset.num_heads}, "
                                      f"the heads of {paper}, which its name ({tv}) names; pass num_heads= "
                                      "(the model's count)")
            hints.num_heads = preset.num_heads
            if dim is not None and dim != preset.dim:
                warn_assumed_heads(source,
                                   f"{preset.num_heads} heads, as {paper} (which the name {tv} names) has, "
                                   f"though its width is {dim}, not {preset.dim}")
            break
    defaults = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD, "ln_eps": 1e-6, "gelu": "exact"}
    for k, v in defaults.items():
        hints.config.setdefault(k, v)
    return hints


IMAGENET_RECIPE = {"interpolation": "bilinear", "crop_pct": 224 / 256}  # resize to 256, centre crop of 224
SWAG_RECIPE = {"interpolation": "bicubic", "crop_pct": 1.0}  # resize to the model's size, no crop


def preprocessing_for(state: dict[str, torch.Tensor]) -> dict[str, float | str]:
    """torchvision's evaluation resize and crop for weights with this position table: its ImageNet recipe up
    to the 224 px grid, its SWAG weights' for a larger one (they are trained at 384, 512 and 518 px)."""
    if "pos_embed" not in state or "patch_embed.proj.weight" not in state:
        return IMAGENET_RECIPE
    patches = state["pos_embed"].shape[1] - 1  # torchvision's table always has the class token's row
    side = 224 // state["patch_embed.proj.weight"].shape[-1]
    return IMAGENET_RECIPE if patches <= side * side else SWAG_RECIPE


def from_torchvision(state: dict[str, torch.Tensor], hints: Hints, source: str) -> Converted:
    state = rename(state, RULES, source, "torchvision")
    dim = state["patch_embed.proj.weight"].shape[0] if "patch_embed.proj.weight" in state else None
    hints = torchvision_hints(hints, dim, source)
    for k, v in preprocessing_for(state).items():
        hints.config.setdefault(k, v)
    # torchvision's VisionTransformer takes one image_size (square) and classifies from its class token.
    cfg = infer_config(state, hints, source, square_only=True)
    return Converted(cfg, state, default_class_names(cfg.num_classes, hints.class_names), source,
                     "torchvision")
