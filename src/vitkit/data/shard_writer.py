"""`write_shards`: any dataset vitkit reads, written as WebDataset-style tar shards plus an index.json.

Each sample is `KEY.EXT` (the image) and `KEY.cls` (the label), KEY the sample's place in the source's own
order (9 digits), so that a key names one image of the source. An image folder's files go in as their bytes,
unchanged; an image held in memory (Fashion-MNIST, CIFAR, a Hugging Face dataset) is encoded losslessly as
PNG. The samples are written in a random order drawn from `seed`: a folder lists its files class by class, and
shards of one class each would make batches of one class, since training shuffles shards and the samples
within each shard, not across them.

webdataset's ShardWriter cuts a new shard once one reaches `max_bytes` (so a shard exceeds it by at most one
sample). Member times are fixed, so the same source and seed give the same bytes.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import torch
from torch.utils.data import Dataset

from .shards import INDEX_FORMAT, INDEX_NAME, require_data_extra

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_EXTENSIONS = {"jpeg": "jpg", "tif": "tiff"}


def parse_size(text: str) -> int:
    """'500MB', '1GB', '64KiB' or a number of bytes -> bytes (KB, MB, GB: powers of 1000; KiB, MiB, GiB:
    of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise ValueError(f"shard size {text!r} is not a size: give a number and a unit, e.g. 500MB, 1GB, "
                         "256MiB")
    return int(float(m.group(1)) * _UNITS[unit])


def _image_bytes(dataset: Dataset, index: int) -> tuple[bytes, str, int]:
    """Item `index`'s image as (bytes, extension, label): a folder's file as it is, anything else as PNG."""
    samples = getattr(dataset, "samples", None)
    if samples is not None and isinstance(samples[index][0], Path):  # an image folder: the file itself
        path, label = samples[index]
        ext = path.suffix.lower().lstrip(".")
        return path.read_bytes(), _EXTENSIONS.get(ext, ext), int(label)
    image, label = dataset[index]
    if torch.is_tensor(image):  # uint8 (C, H, W)
        from torchvision.transforms.v2.functional import to_pil_image

        image = to_pil_image(image)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue(), "png", int(label)


def num_channels(dataset: Dataset) -> int:
    return int(getattr(dataset, "num_channels", 3))


def write_shards(dataset: Dataset, out: Path, max_bytes: int, prefix: str = "train", seed: int = 0,
                 progress: bool = True, source: str = "") -> dict:
    """Write `dataset` into `out` (an empty or new folder) as `PREFIX-000000.tar`, ... and `index.json`;
    returns the index."""
    from tqdm import tqdm

    require_data_extra("webdataset")
    from webdataset import ShardWriter

    out.mkdir(parents=True, exist_ok=True)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    counts: dict[str, int] = {}
    pattern = str(out / f"{prefix}-%06d.tar")
    with ShardWriter(pattern, maxsize=max_bytes, maxcount=10**12, verbose=0, mtime=0.0) as writer:
        for index in tqdm(order, desc=f"writing {out.name}", unit="img", disable=not progress):
            data, ext, label = _image_bytes(dataset, index)
            writer.write({"__key__": f"{index:09d}", ext: data, "cls": str(label).encode()})
            name = Path(writer.fname).name
            counts[name] = counts.get(name, 0) + 1
    index = {"format": INDEX_FORMAT, "version": 1, "source": source, "seed": seed,
             "classes": list(getattr(dataset, "classes", [])), "num_channels": num_channels(dataset),
             "total": len(dataset), "shards": [{"name": k, "count": v} for k, v in counts.items()]}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n")
    return index


def shard_pattern(index: dict, out: Path) -> str:
    """The brace pattern that names every shard of `index` in `out`, e.g. OUT/train-{000000..000003}.tar."""
    names = [s["name"] for s in index["shards"]]
    if len(names) == 1:
        return str(out / names[0])
    prefix = names[0].rsplit("-", 1)[0]
    return f"{out / prefix}-{{{names[0].rsplit('-', 1)[1][:-4]}..{names[-1].rsplit('-', 1)[1][:-4]}}}.tar"
