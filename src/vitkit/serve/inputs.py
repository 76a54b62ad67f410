"""What a request sends, checked: an image's bytes (decoded with the checks and limits of vitkit.data.images)
or a preprocessed tensor of the model's input shape. Each way it can be wrong is a RequestError with the
status a client can act on."""

from __future__ import annotations

import math
import re

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


_BOUNDARY = re.compile(r'boundary=(?:"([^"]+)"|([^;\s]+))', re.IGNORECASE)
_DISPOSITION = re.compile(rb"^content-disposition:([^\r\n]*)", re.IGNORECASE | re.MULTILINE)
_PARAMETER = re.compile(rb';\s*([\w-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;\s]*)')


def _part_name(headers: bytes) -> str | None:
    """The `name` parameter of a part's Content-Disposition header (quoted strings read whole, so that a
    file name holding "; name=" is not taken for it)."""
    line = _DISPOSITION.search(headers)
    for key, value in _PARAMETER.findall(line.group(1)) if line else ():
        if key.lower() == b"name":
            return (value[1:-1] if value.startswith(b'"') else value).decode("latin-1")
    return None


def form_field(body: bytes, content_type: str, field: str = "file") -> bytes:
    """The content of the part named `field` of a multipart/form-data body (RFC 7578), what `curl -F
    file=@cat.jpg`, a browser's FormData and `requests`' files= send. The parts are found with bytes.find:
    no copies but the one returned, no temporary files (the body is held whole already, under the server's
    byte cap). A body without that part, or cut short, is a 400 saying so."""
    match = _BOUNDARY.search(content_type)
    if match is None:
        raise RequestError(400, "the multipart/form-data Content-Type has no boundary")
    delimiter = b"--" + (match.group(1) or match.group(2)).encode("latin-1")
    pos = body.find(delimiter)
    while pos >= 0 and not body.startswith(b"--", pos + len(delimiter)):
        start = body.find(b"\r\n", pos + len(delimiter))  # the delimiter line ends (after any padding)
        head_end = body.find(b"\r\n\r\n", start) if start >= 0 else -1
        end = body.find(b"\r\n" + delimiter, head_end + 4) if head_end >= 0 else -1
        if end < 0:
            raise RequestError(400, "the multipart body is cut short (a part without its closing boundary)")
        if _part_name(body[start:head_end + 2]) == field:
            return body[head_end + 4:end]
        pos = end + 2
    raise RequestError(400, f"the multipart form has no file part named {field!r}")


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
