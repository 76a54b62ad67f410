"""WebDataset-style tar shards as a training set: `shards:PATTERN` (vitkit.data.resolve) names them.

A shard is a tar of samples, each a run of members sharing one key: `KEY.jpg` or `KEY.png` (the image's
bytes) and `KEY.cls` (the label as a decimal number), as `vitkit shard` writes them (shard_writer.py). The
pattern is expanded as webdataset expands it (braceexpand: `/data/in21k-{000000..000999}.tar`). The
`index.json` beside the shards gives each shard's sample count and the class names, so that every process
computes the epoch's length and plan without opening a tar; without it the tar headers are read once and the
count is said on stderr.

A `ShardSet` is not a map-style dataset: random access into a tar stream is a scan, so training reads it
through vitkit.train.shard_batches, which streams each shard with webdataset's tar iterator and decodes only
the samples one DataLoader worker needs. `read_shard` is that read.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from .images import decode_image

INDEX_NAME = "index.json"
INDEX_FORMAT = "vitkit-shards"
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm", "pnm")
SHARDS_PREFIX = "shards:"


@dataclass(frozen=True)
class ShardSet:
    """Shards (paths, in pattern order), their sample counts, the class names and the images' channels."""

    paths: tuple[Path, ...]
    counts: tuple[int, ...]
    classes: tuple[str, ...]
    num_channels: int = 3
    pattern: str = ""

    def __len__(self) -> int:
        return sum(self.counts)

    @property
    def targets(self) -> None:  # no per-sample labels without reading the shards
        return None

    def __repr__(self) -> str:
        return f"ShardSet({self.pattern!r}, {len(self.paths)} shards, {len(self)} samples)"


def require_data_extra(module: str) -> None:
    """Import `module` (webdataset, braceexpand, datasets), or say which install extra brings it."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise ValueError(f"reading shards and Hugging Face dataset folders needs {module}: "
                         "pip install 'vitkit[data]'") from None


def expand_pattern(pattern: str) -> list[Path]:
    """The shard files a brace pattern names, in order; every one must exist."""
    require_data_extra("braceexpand")
    import braceexpand

    paths = [Path(p).expanduser() for p in braceexpand.braceexpand(pattern)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise FileNotFoundError(f"shards:{pattern}: {missing[0]}{more} not found (the pattern expands to "
                                f"{len(paths)} file(s); write shards with `vitkit shard SRC OUT`)")
    return paths


def open_shards(pattern: str) -> ShardSet:
    """The ShardSet of `pattern`, counted from the index.json beside its first shard, or from the tar headers
    of the shards the index lacks (a note on stderr says so)."""
    paths = expand_pattern(pattern)
    require_data_extra("webdataset")
    index = read_index(paths[0].parent / INDEX_NAME)
    known = {s["name"]: int(s["count"]) for s in index.get("shards", [])}
    counts, scanned, labels = [], [], set()
    for path in paths:
        if path.name in known:
            counts.append(known[path.name])
        else:
            n, found = scan_shard(path)
            counts.append(n)
            scanned.append(path.name)
            labels |= found
    if scanned:
        print(f"note: shards:{pattern}: no {INDEX_NAME} entry for {len(scanned)} shard(s) ({scanned[0]}, "
              "...); counted their samples by reading the tar headers (`vitkit shard` writes the index)",
              file=sys.stderr, flush=True)
    classes = index.get("classes") or [str(i) for i in range(max(labels, default=-1) + 1)]
    if not classes:
        raise ValueError(f"shards:{pattern}: no class names in {INDEX_NAME} and no .cls labels in the shards")
    return ShardSet(tuple(paths), tuple(counts), tuple(classes), int(index.get("num_channels", 3)), pattern)


def read_index(path: Path) -> dict:
    """A shard folder's index.json as a dict ({} when there is none); a damaged one is refused, named."""
    if not path.is_file():
        return {}
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable ({e}); rewrite the shards with `vitkit shard`, or remove it to "
                         "count the samples from the tars") from None
    if index.get("format") != INDEX_FORMAT:
        raise ValueError(f"{path}: not a vitkit shard index (format {index.get('format')!r}); remove it to "
                         "count the samples from the tars")
    return index


def _members(path: Path, select: Callable[[str], bool] | None) -> Iterator[dict]:
    """The tar members of `path` (dicts of fname and data) through webdataset's iterator; `select` keeps a
    member's bytes from being read into memory (tarfile still streams past them)."""
    from webdataset.tariterators import tar_file_iterator

    with open(path, "rb") as f:
        yield from tar_file_iterator(f, select_files=select)


def split_name(fname: str) -> tuple[str, str]:
    """A member's (key, suffix): webdataset's rule, the suffix after the first dot of the file name."""
    from webdataset.tariterators import base_plus_ext

    key, suffix = base_plus_ext(fname)
    return key or "", (suffix or "").lower()


def scan_shard(path: Path) -> tuple[int, set[int]]:
    """The number of samples in a shard and the labels they carry, read from the tar headers and the small
    `.cls` members only."""
    keys, labels, last = 0, set(), None

    def select(fname: str) -> bool:
        nonlocal keys, last
        key, suffix = split_name(fname)
        if key != last:
            keys, last = keys + 1, key
        return suffix == "cls"

    for member in _members(path, select):
        labels.add(int(member["data"]))
    return keys, labels


def read_shard(path: Path, wanted: Sequence[int] | set[int]) -> dict[int, dict]:
    """Samples of a shard by position (0-based, in tar order): {position: {"__key__", suffix: bytes, ...}}
    for the positions in `wanted`; the other samples' bytes are passed over, not kept."""
    wanted = set(wanted)
    position, last = -1, None

    def select(fname: str) -> bool:
        nonlocal position, last
        key, _ = split_name(fname)
        if key != last:
            position, last = position + 1, key
        return position in wanted

    samples: dict[int, dict] = {}
    position_of: dict[str, int] = {}
    for member in _members(path, select):
        key, suffix = split_name(member["fname"])
        if key not in position_of:
            position_of[key] = position
            samples[position] = {"__key__": key}
        samples[position_of[key]][suffix] = member["data"]
    if len(samples) != len(wanted):
        raise ValueError(f"{path}: holds fewer samples than its count says ({len(samples)} of the "
                         f"{len(wanted)} asked for); rewrite its index.json or the shard")
    return samples


def decode_sample(sample: dict, mode: str = "RGB", where: str = "") -> tuple[Image.Image, int]:
    """A shard sample's (PIL image in `mode`, int label)."""
    suffix = next((s for s in IMAGE_SUFFIXES if s in sample), None)
    if suffix is None or "cls" not in sample:
        raise ValueError(f"{where}{sample['__key__']}: a sample needs an image ({', '.join(IMAGE_SUFFIXES)}) "
                         f"and a .cls label; it has {sorted(k for k in sample if k != '__key__')}")
    name = f"{where}{sample['__key__']}.{suffix}"
    return decode_image(sample[suffix], mode, name=name), int(sample["cls"])
