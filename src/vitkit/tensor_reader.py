"""Reading a safetensors file straight into the memory its tensors will keep.

`safetensors.torch.load_file` maps the file and hands out tensors that live in the mapping, at the file's
8-byte alignment. A model that adopts them (load_state_dict with assign=True) runs the kernels on misaligned
weights (other code paths: slower, and not bit for bit what the same weights give at PyTorch's 64-byte
alignment); one that copies them holds the mapped file and the copy at once, twice the file at the peak.
`read_safetensors` reads each tensor's bytes with `readinto` into a tensor PyTorch allocated: aligned, and at
the peak the file's size once. The format is the one safetensors documents: an 8-byte little-endian header
length, a JSON header of {name: {dtype, shape, data_offsets}} (and `__metadata__`), then the data.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


class FormatError(ValueError):
    """The file is not a safetensors file this reader can read; the message says why."""


def read_header(f) -> tuple[dict, int]:
    """The header's tensor entries (without `__metadata__`) and where the data starts, from the open file."""
    raw = f.read(8)
    if len(raw) < 8:
        raise FormatError("shorter than a safetensors header")
    n = int.from_bytes(raw, "little")
    if n > MAX_HEADER:
        raise FormatError(f"a header of {n} bytes (not a safetensors file?)")
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise FormatError("its header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + n


def entries(header: dict) -> list[tuple[int, int, str, torch.dtype, list[int]]]:
    """(begin, end, name, dtype, shape) of each tensor of a header, in the order of the data."""
    out = []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = DTYPES[entry["dtype"]], [int(n) for n in entry["shape"]], \
                entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"tensor {name!r}: an entry safetensors does not write ({entry})") from None
        out.append((int(begin), int(end), name, dtype, shape))
    return sorted(out)


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file `path`, each in memory of its own (module docstring). Raises
    FormatError for a file that is not one (a truncated file included), OSError where it cannot be read."""
    path = Path(path)
    size = path.stat().st_size
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb", buffering=0) as f:
        header, start = read_header(f)
        for begin, end, name, dtype, shape in entries(header):
            nbytes = math.prod(shape) * dtype.itemsize
            if end - begin != nbytes or begin < 0 or start + end > size:
                raise FormatError(f"tensor {name!r}: {end - begin} bytes at {begin} for shape {shape} of "
                                  f"{dtype} (the file has {size - start} bytes of data)")
            tensor = torch.empty(shape, dtype=dtype)
            f.seek(start + begin)
            into = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            while into:  # readinto may return less than asked
                got = f.readinto(into)
                if not got:
                    raise FormatError(f"tensor {name!r}: the file ends before its data does")
                into = into[got:]
            out[name] = tensor
    return out
