"""Frozen representations of a whole dataset, extracted once in batches and optionally cached.

The representation is what the classifier sees: `forward_head(features, pre_logits=True)` (the class token
or the mean patch token after the final LayerNorm, through the pre-logits layer if the model has one), as
big_vision's few-shot evaluator uses. The cache is a safetensors file holding the features and labels, with
fingerprints of the model's weights and of the data in its metadata: a cache made for other weights or other
data is recomputed, never silently reused.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from ..files import save_safetensors

CACHE_FORMAT = "vitkit-features"


@dataclass(frozen=True)
class Features:
    features: torch.Tensor  # (N, D) float32
    labels: torch.Tensor  # (N,) int64


def model_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of the model's config and every tensor of its state dict (names, shapes, dtypes, bytes)."""
    h = hashlib.sha256()
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "to_dict"):
        h.update(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def data_fingerprint(dataset, n: int) -> str:
    """SHA-256 of what the first `n` items are: for a folder, each file's path, size, modification time and
    label; for images in memory, their bytes and labels; otherwise the labels where the dataset lists them
    (`targets`), else nothing beyond `n` (the caller's data key must then name the data)."""
    h = hashlib.sha256()
    samples = getattr(dataset, "samples", None)
    images, targets = getattr(dataset, "images", None), getattr(dataset, "targets", None)
    if samples is not None:
        for path, label in samples[:n]:
            try:
                st = os.stat(path)
                h.update(f"{path}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            except OSError:
                h.update(f"{path}\0{label}\0missing\n".encode())
    elif isinstance(images, torch.Tensor):
        h.update(images[:n].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    if isinstance(targets, torch.Tensor):
        h.update(targets[:n].to(torch.int64).contiguous().numpy().tobytes())
    h.update(json.dumps(list(getattr(dataset, "classes", None) or [])).encode())
    return h.hexdigest()


def iterate_batches(dataset, batch_size: int, transform: Callable | None = None, limit: int | None = None,
                    num_workers: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(images, labels) batches of a dataset of (image, label) items; `transform` turns an item's image
    into a (C, H, W) tensor when it is not one already. `limit` takes the first items only."""
    n = len(dataset) if limit is None else min(limit, len(dataset))
    indices = range(n)
    subset = torch.utils.data.Subset(dataset, indices) if n < len(dataset) else dataset

    def collate(items):
        images, labels = zip(*items, strict=True)
        if transform is not None:
            images = [transform(im) for im in images]
        for i, im in enumerate(images):
            if not isinstance(im, torch.Tensor):
                raise ValueError(f"item {i} of a batch is a {type(im).__name__}, not a tensor: give a "
                                 "transform")
        return torch.stack(list(images)), torch.as_tensor([int(y) for y in labels], dtype=torch.int64)

    loader = torch.utils.data.DataLoader(subset, batch_size=batch_size, shuffle=False,
                                         num_workers=num_workers, collate_fn=collate)
    yield from loader


def _eval_transform_for_images(cfg) -> Callable:
    """The model's evaluation transform for images that are not yet float tensors; float tensors pass."""
    from ..data.transforms import build_eval_transform

    evaluation = build_eval_transform(cfg)
    return lambda image: (image if isinstance(image, torch.Tensor) and image.is_floating_point()
                          else evaluation(image))


@torch.inference_mode()
def compute_features(model, dataset, batch_size: int = 128, transform: Callable | None = None,
                     limit: int | None = None, device: str | torch.device = "cpu", num_workers: int = 0,
                     progress: bool = True, desc: str = "features") -> Features:
    """Representations of the dataset's first `limit` items (all by default), in order, computed in eval mode
    on `device` (the model is moved there, and left in the training mode it came in).

    `transform` turns an item's image into the model's input; without one, images that are not float tensors
    (PIL images, uint8 tensors as vitkit.data's datasets hold) go through the model's evaluation transform
    (`build_eval_transform(model.cfg)`), and float tensors are taken as inputs already."""
    if transform is None and hasattr(model, "cfg"):
        transform = _eval_transform_for_images(model.cfg)
    was_training = model.training
    model = model.to(device).eval()
    n = len(dataset) if limit is None else min(limit, len(dataset))
    feats, labels = [], []
    try:
        with tqdm(total=n, desc=desc, unit="img", disable=not progress) as bar:
            for x, y in iterate_batches(dataset, batch_size, transform, limit, num_workers):
                f = model.forward_head(model.forward_features(x.to(device)), pre_logits=True)
                feats.append(f.float().cpu())
                labels.append(y)
                bar.update(len(y))
    finally:
        model.train(was_training)
    if not feats:
        raise ValueError("the dataset is empty: no features to extract")
    return Features(torch.cat(feats), torch.cat(labels))


def _read_cache(path: Path, meta: dict[str, str]) -> Features | None:
    """The cached features if `path` holds them for exactly this model and data, else None."""
    try:
        with safe_open(str(path), framework="pt") as f:
            stored = f.metadata() or {}
            if any(stored.get(k) != v for k, v in meta.items()):
                return None
            return Features(f.get_tensor("features"), f.get_tensor("labels"))
    except (SafetensorError, OSError, KeyError, ValueError):
        return None  # unreadable or foreign: recompute and overwrite


def extract_features(model, dataset, cache: str | os.PathLike | None = None, data_key: str = "",
                     **kwargs: Any) -> Features:
    """`compute_features`, through a cache file when `cache` is given.

    `data_key` names the data (e.g. "fashion-mnist:train"); together with the model's fingerprint, the
    number of items, the data's fingerprint (`data_fingerprint`: files, sizes, times and labels of a folder)
    and the transform's description it decides whether the cache is valid.
    """
    if cache is None:
        return compute_features(model, dataset, **kwargs)
    path = Path(cache)
    limit = kwargs.get("limit")
    n = len(dataset) if limit is None else min(limit, len(dataset))
    meta = {
        "format": CACHE_FORMAT,
        "model": model_fingerprint(model),
        "data": data_key,
        "count": str(n),
        "content": data_fingerprint(dataset, n),
        "transform": repr(kwargs.get("transform")),
    }
    cached = _read_cache(path, meta) if path.is_file() else None
    if cached is not None:
        return cached
    result = compute_features(model, dataset, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_safetensors({"features": result.features.contiguous(), "labels": result.labels.contiguous()}, tmp,
                     metadata=meta)
    os.replace(tmp, path)  # atomic: a crash never leaves half a cache
    return result
