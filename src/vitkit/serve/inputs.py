"""What a request sends, checked: an image's bytes (decoded with the checks and limits of vitkit.data.images)
or a preprocessed tensor of the model's input shape. Each way it can be wrong is a RequestError with the
status a client can act on."""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

from ..config import ViTConfig
from ..data.images import BadImageError, decode_image
from .errors import RequestError

# The HTTP status for each reason an image is refused.
STATUS_OF_REASON = {"empty": 400, "not-an-image": 415, "too-many-pixels": 413, "corrupt": 422}


def decode_upload(data: bytes, mode: str, max_pixels: int, name: str = "image") -> Image.Image:
    """An uploaded image decoded in `mode` ('RGB' or 'L') with vitkit.data.images' checks; a bad one is a
    RequestError: 400 empty, 413 over `max_pixels`, 415 not an image, 422 corrupt or truncated."""
    try:
        return decode_image(data, mode, max_pixels, name)
    except BadImageError as e:
        raise RequestError(STATUS_OF_REASON.get(e.reason, 422), str(e)) from None


def input_shape(cfg: ViTConfig) -> list[int]:
    """The model's input shape without the batch: [C, H, W]."""
    return [cfg.in_chans, *cfg.image_size]


def tensor_input(data, shape, datatype: str, cfg: ViTConfig, name: str = "input") -> torch.Tensor:
    """An Open Inference Protocol tensor (its `data`, flat or nested, its `shape` and `datatype`) checked
    against the model's input: FP32, [N, C, H, W] or [C, H, W]; returns (N, C, H, W). Anything else is a 400
    naming what was expected."""
    expected = input_shape(cfg)
    want = f"FP32 of shape [N, {', '.join(map(str, expected))}]"
    if datatype != "FP32":
        raise RequestError(400, f"{name}: datatype {datatype!r}; this model takes {want}")
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
        raise RequestError(400, f"{name}: shape {shape!r} is not a list of integers; this model takes {want}")
    if shape[-3:] != expected or len(shape) not in (3, 4) or (len(shape) == 4 and shape[0] < 1):
        raise RequestError(400, f"{name}: shape {shape}; this model takes {want}")
    try:
        values = np.asarray(data, dtype=np.float32)
    except (ValueError, TypeError) as e:
        raise RequestError(400, f"{name}: data is not an array of numbers ({e}); this model takes "
                                f"{want}") from None
    if values.size != math.prod(shape):
        raise RequestError(400, f"{name}: {values.size} values for shape {shape} ({math.prod(shape)} values)")
    if not np.isfinite(values).all():
        raise RequestError(400, f"{name}: data holds NaN or infinite values")
    return torch.from_numpy(values.reshape([-1, *expected]).copy())
