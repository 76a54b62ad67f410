"""Classify image files and folders: top-k labels with probabilities. A file that cannot be read gets a
one-line error naming it; the others are still classified."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from ..config import ViTConfig
from ..data.images import BadImageError, image_files, open_image
from ..data.transforms import build_eval_transform


@dataclass
class Prediction:
    path: Path
    labels: list[str]
    probs: list[float]


@dataclass
class Failure:
    path: Path
    message: str


def expand_paths(paths: Iterable[str | Path]) -> tuple[list[Path], list[Failure]]:
    """Files as given (tried whatever their name), and the image files inside folders as an image-folder
    dataset finds them (`vitkit.data.images.image_files`: by IMAGE_EXTENSIONS, recursively, hidden files and
    folders and __MACOSX skipped, symbolic links to folders followed). Paths that do not exist come back as
    failures; a broken symbolic link is given to open_image, which says so."""
    files, failures = [], []
    for p in map(Path, paths):
        if p.is_dir():
            files += image_files(p)
        elif p.is_file() or p.is_symlink():
            files.append(p)
        else:
            failures.append(Failure(p, f"{p}: no such file or folder"))
    return files, failures


def predict(model: nn.Module, paths: Iterable[str | Path], cfg: ViTConfig | None = None, top_k: int = 5,
            class_names: list[str] | None = None, batch_size: int = 64,
            device: torch.device | str = "cpu") -> tuple[list[Prediction], list[Failure]]:
    """Top-k predictions for every image in `paths` (files and folders), in order, and the failures:
    `classify`'s results gathered."""
    predictions: list[Prediction] = []
    failures: list[Failure] = []
    for r in classify(model, paths, cfg, top_k, class_names, batch_size, device):
        (predictions if isinstance(r, Prediction) else failures).append(r)
    return predictions, failures


def classify(model: nn.Module, paths: Iterable[str | Path], cfg: ViTConfig | None = None, top_k: int = 5,
             class_names: list[str] | None = None, batch_size: int = 64,
             device: torch.device | str = "cpu") -> Iterator[Prediction | Failure]:
    """Top-k predictions for the images in `paths` (files and folders), in order, as each batch of
    `batch_size` is classified, and a Failure for each path that does not exist or file that cannot be read,
    as it is met: a folder of 50,000 images shows its first results after one batch, not after all of them."""
    yield from classify_expanded(model, expand_paths(paths), cfg, top_k, class_names, batch_size, device)


def label_names(model: nn.Module, cfg: ViTConfig | None = None,
                class_names: list[str] | None = None) -> list[str]:
    """The name of each class the model predicts: `class_names`, else the model's own, else "0", "1", ...;
    a model without a classifier, or names that do not match its classes, is a ValueError."""
    cfg = cfg or model.cfg
    if cfg.num_classes == 0:
        raise ValueError("this model has no classifier (num_classes=0): it gives features, not labels; give "
                         "it a head first (vitkit train finetune, or vitkit.transfer.prepare_finetune)")
    names = class_names or getattr(model, "class_names", None) or [str(i) for i in range(cfg.num_classes)]
    if len(names) != cfg.num_classes:
        raise ValueError(f"{len(names)} class names for a model with {cfg.num_classes} classes")
    return list(names)


@torch.no_grad()
def probabilities(model: nn.Module, x: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """The class probabilities of a batch of model inputs (B, C, H, W): float32 on the CPU, (B, classes)."""
    return model(x.to(device)).float().softmax(dim=-1).cpu()


def top_labels(probs: torch.Tensor, names: list[str], k: int) -> list[tuple[list[str], list[float]]]:
    """Each row's `k` most probable labels with their probabilities, most probable first."""
    top = probs.topk(min(k, probs.shape[-1]), dim=-1)
    # whole tensors to lists at once: iterating a tensor makes a tensor a row (twice the time a request)
    values, indices = top.values.tolist(), top.indices.tolist()
    return [([names[j] for j in i], p) for p, i in zip(values, indices, strict=True)]


def classify_expanded(model: nn.Module, expanded: tuple[list[Path], list[Failure]],
                      cfg: ViTConfig | None = None,
                      top_k: int = 5, class_names: list[str] | None = None, batch_size: int = 64,
                      device: torch.device | str = "cpu") -> Iterator[Prediction | Failure]:
    """`classify` of what `expand_paths` found (its files and the paths that do not exist), for a caller that
    walked the folders already (the command line counts the images for its progress bar)."""
    cfg = cfg or model.cfg
    names = label_names(model, cfg, class_names)
    transform = build_eval_transform(cfg)
    files, missing = expanded
    yield from missing
    mode = "L" if cfg.in_chans == 1 else "RGB"
    batch: list[tuple[Path, torch.Tensor]] = []

    def classified() -> list[Prediction]:
        probs = probabilities(model, torch.stack([t for _, t in batch]), device)
        done = [Prediction(path, labels, p)
                for (path, _), (labels, p) in zip(batch, top_labels(probs, names, top_k), strict=True)]
        batch.clear()
        return done

    for f in files:
        try:
            batch.append((f, transform(open_image(f, mode))))
        except (BadImageError, OSError) as e:
            yield Failure(f, str(e) if str(f) in str(e) else f"{f}: {e}")
            continue
        if len(batch) == batch_size:
            yield from classified()
    if batch:
        yield from classified()
