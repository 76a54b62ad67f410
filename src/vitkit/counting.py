"""Parameter and FLOP counts of a ViT config, computed on the meta device (nothing is allocated)."""

from __future__ import annotations

import torch

from .config import ViTConfig, get_config
from .model import VisionTransformer, build_patch_embed


def _config(cfg: ViTConfig | str) -> ViTConfig:
    """A config, or the preset a name names ("ViT-B/16", "vit_base_patch16_224")."""
    if isinstance(cfg, ViTConfig):
        return cfg
    if isinstance(cfg, str):
        return get_config(cfg)
    raise TypeError(f"expected a ViTConfig or a preset name, got {type(cfg).__name__}")


def count_parameters(cfg: ViTConfig | str) -> int:
    """Parameters of the model `cfg` (a config or a preset name) builds, counted on the meta device (nothing
    is allocated)."""
    cfg = _config(cfg)
    with torch.device("meta"):
        model = VisionTransformer(cfg)
    return sum(p.numel() for p in model.parameters())


def count_flops(cfg: ViTConfig | str) -> float:
    """FLOPs per image (2 per multiply-add) of the transformer, patch projection and head, for a config or a
    preset name: of the plain model's forward, every token through every block. (The class-token shortcut of
    `vitkit.accelerate` and `vitkit.optimize` does less with token pooling: vitkit.shortcut.)

    Per layer: 12 T D^2 (qkv, projection, MLP at 4D) generalised to any MLP size, plus 2 T^2 D for the
    attention matrix and its product with the values. A hybrid's ResNet has no short closed form: its
    patch embedding (ResNet and projection) is counted by torch's FlopCounterMode on the meta device (nothing
    is allocated).
    """
    cfg = _config(cfg)
    T, D = cfg.num_tokens, cfg.dim
    per_layer = T * (4 * D * D + 2 * D * cfg.mlp_dim) + 2 * T * T * D
    if cfg.hybrid_layers is not None:
        from torch.utils.flop_counter import FlopCounterMode

        with torch.device("meta"):
            embed = build_patch_embed(cfg)
            with FlopCounterMode(display=False) as counter:
                embed(torch.empty(1, cfg.in_chans, *cfg.image_size))
        patch = counter.get_total_flops() // 2
    else:
        with torch.device("meta"):  # kernel = stride: one multiply-add per weight per patch (SPT's too)
            patch = cfg.num_patches * build_patch_embed(cfg).proj.weight.numel()
    head_in = cfg.representation_size or D
    head = (D * cfg.representation_size if cfg.representation_size else 0) + head_in * max(cfg.num_classes, 0)
    macs = cfg.depth * per_layer + patch + head
    return 2.0 * macs
