"""Transfer as in Sec. 3.2: take a pre-trained model to a new task and, often, a higher resolution.

The pre-training head (pre-logits and classifier) is dropped, a zero-initialised linear head for the new
classes is attached, and the position embedding is 2D-interpolated to the new grid of patches.
"""

from __future__ import annotations

from typing import Any

import torch

from .model import VisionTransformer, resample_state_dict


def prepare_finetune(
    source: str | VisionTransformer,
    num_classes: int,
    image_size: int | tuple[int, int] | None = None,
    interpolation: str = "bicubic",
    **overrides: Any,
) -> VisionTransformer:
    """A model initialised from `source` (anything `vitkit.load` accepts, or a model) for `num_classes`
    classes at `image_size` (default: the source's). `overrides` change other config fields that do not
    alter the weights' shapes (dropout, drop_path, ...)."""
    from . import load

    src = load(source) if not isinstance(source, VisionTransformer) else source
    old = src.cfg
    new = old.replace(
        num_classes=num_classes,
        representation_size=None,
        image_size=image_size if image_size is not None else old.image_size,
        **overrides,
    )
    state = {k: v for k, v in src.state_dict().items() if not k.startswith(("head.", "pre_logits."))}
    state = resample_state_dict(state, old, new, mode=interpolation)
    model = VisionTransformer(new)  # its head is zero-initialised
    missing, unexpected = model.load_state_dict(state, strict=False)
    head_keys = {k for k in model.state_dict() if k.startswith("head.")}
    buffers = {k for k, _ in model.named_buffers()}
    if set(missing) - head_keys - buffers or unexpected:
        raise ValueError(f"cannot transfer {source!r}: missing {sorted(set(missing) - head_keys)}, "
                         f"unexpected {sorted(unexpected)}")
    return model


def num_trainable(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
