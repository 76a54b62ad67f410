"""Transfer as in Sec. 3.2: take a pre-trained model to a new task and, often, a higher resolution.

The pre-training head (pre-logits and classifier) is dropped, a zero-initialised linear head for the new
classes is attached, and the position embedding is 2D-interpolated to the new grid of patches. The source
may be any checkpoint `vitkit.load` reads (vitkit, .npz, timm, Hugging Face, torchvision, hub names) or a
model; what the source records about itself (GELU flavour, LayerNorm eps, mean/std) carries over.
"""

from __future__ import annotations

import os
from typing import Any

from .model import VisionTransformer
from .posemb import resample_state_dict

# Config fields that change the shapes of the pre-trained weights: a transfer cannot override them.
SHAPE_FIELDS = ("patch_size", "in_chans", "dim", "depth", "num_heads", "mlp_dim", "class_token", "pos_embed",
                "qkv_bias", "hybrid_layers", "hybrid_width", "spt")


def prepare_finetune(
    source: str | os.PathLike | VisionTransformer,
    num_classes: int,
    image_size: int | tuple[int, int] | None = None,
    interpolation: str = "bicubic",
    **overrides: Any,
) -> VisionTransformer:
    """A model initialised from `source` for `num_classes` classes at `image_size` (default: the source's,
    any height and width that are multiples of the patch stride).

    `interpolation` is how the position table is resampled (vitkit.posemb.POSEMB_MODES). `overrides` change
    config fields that leave the weights' shapes alone (dropout, attn_dropout, drop_path, pool for a
    class-token model, lsa=True: locality self-attention, its temperatures starting at the source's 1/sqrt(d),
    ...). The model is in training mode, its classifier zero-initialised.
    """
    from .loading import load

    src = source if isinstance(source, VisionTransformer) else load(source)
    old = src.cfg
    fixed = sorted(set(overrides) & set(SHAPE_FIELDS))
    if fixed:
        raise ValueError(f"cannot change {fixed} when transferring from {_name(source)}: they set the shapes "
                         "of the pre-trained weights")
    if old.lsa and overrides.get("lsa") is False:
        raise ValueError(f"cannot turn lsa off when transferring from {_name(source)}: its attention learned "
                         "its own temperatures and never attended to itself")
    new = old.replace(
        num_classes=num_classes,
        representation_size=None,  # the pre-training head goes (Sec. 3.2)
        image_size=image_size if image_size is not None else old.image_size,
        **overrides,
    )
    state = {k: v for k, v in src.state_dict().items() if not k.startswith(("head.", "pre_logits."))}
    state = resample_state_dict(state, old, new, mode=interpolation)
    model = VisionTransformer(new)  # its head is zero-initialised
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Fresh: the new head and, when lsa is turned on, the temperatures, which start at 1/sqrt(d) as the
    # source's attention scaled its scores.
    fresh = {k for k in model.state_dict()
             if k.startswith("head.") or (not old.lsa and k.endswith(".head_scale"))}
    if set(missing) - fresh or unexpected:
        raise ValueError(f"cannot transfer {_name(source)}: missing {sorted(set(missing) - fresh)}, "
                         f"unexpected {sorted(unexpected)}")
    model.class_names = None
    return model.train()


def _name(source: object) -> str:
    return repr(str(source)) if not isinstance(source, VisionTransformer) else "the given model"
