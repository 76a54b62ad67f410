"""Evaluation: top-1, top-5, mean cross-entropy, per-class accuracy and the confusion matrix, from one pass.

`evaluate` returns plain numbers (an `EvalResult`); `confusion_png` draws the matrix with matplotlib. In a
distributed run each process evaluates its share (every W-th image) and the sums are added up. Each readable
image is scored exactly once: an image folder's unreadable files (with `skip_bad_images`) are counted as
skipped, not replaced by the next good file as training replaces them.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from ..config import ViTConfig
from ..data.transforms import build_eval_transform, normalize_batch
from ..data.views import TransformedDataset
from ..extras import available, install_hint
from .batches import is_in_memory
from .distributed import all_reduce_sum
from .stopping import ignore_stop_signals


@dataclass
class EvalResult:
    """Metrics over `count` images. `loss` is the mean of evaluate's `loss_fn` (softmax cross-entropy unless
    the run trains with another loss). `confusion[i, j]` counts images of class i predicted as class j.
    `skipped`: unreadable image files left out (an image folder with `skip_bad_images`)."""

    top1: float
    top5: float
    loss: float
    count: int
    confusion: torch.Tensor = field(repr=False)
    class_names: list[str] = field(default_factory=list, repr=False)
    skipped: int = 0

    @property
    def has_top5(self) -> bool:
        """Whether top-5 says anything: with 5 classes or fewer every label is among the top 5 (it is 1)."""
        return self.confusion.shape[0] > 5

    @property
    def reported_top5(self) -> float | None:
        """top5, or None with 5 classes or fewer (see has_top5): what the logs and JSON files record."""
        return self.top5 if self.has_top5 else None

    def summary(self) -> str:
        """'top-1 87.50 %, top-5 99.10 %' (top-1 alone with 5 classes or fewer)."""
        return (f"top-1 {100 * self.top1:.2f} %"
                + (f", top-5 {100 * self.top5:.2f} %" if self.has_top5 else ""))

    @property
    def per_class(self) -> list[float]:
        """Accuracy on the images of each class (nan for a class with no image)."""
        totals = self.confusion.sum(dim=1).double()
        return (self.confusion.diag().double() / totals).tolist()

    def to_dict(self) -> dict:
        """The metrics as JSON-ready values: a class with no images has accuracy None (JSON null), not nan,
        which json.dumps would write as the bare `NaN` that JSON does not allow; top-5 is None with 5 classes
        or fewer (see has_top5)."""
        names = self.class_names or [str(i) for i in range(self.confusion.shape[0])]
        return {
            "top1": self.top1, "top5": self.reported_top5, "loss": _finite_or_none(self.loss),
            "count": self.count, "skipped": self.skipped,
            "per_class": {name: _finite_or_none(acc)
                          for name, acc in zip(names, self.per_class, strict=True)},
            "confusion": self.confusion.tolist(),
        }


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


class _ReadableItems(TransformedDataset):
    """Each item of `dataset` through `transform`, or None for an unreadable file that is skipped."""

    def __getitem__(self, index: int):
        return self.read(index)


def _collate_readable(items: list) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """A batch of the readable items and the number skipped; (None, None, n) when none was readable."""
    good = [item for item in items if item is not None]
    if not good:
        return None, None, len(items)
    x, y = default_collate(good)
    return x, y, len(items) - len(good)


def eval_batches(dataset: Dataset, cfg: ViTConfig, batch_size: int, rank: int = 0, world: int = 1,
                 workers: int = 0) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None, int]]:
    """(images, labels, skipped) batches of this process's share, preprocessed for a model of config `cfg`;
    `skipped` counts the batch's unreadable files, left out (images and labels are None when all were)."""
    if is_in_memory(dataset):
        images, targets = dataset.images[rank::world], dataset.targets[rank::world]
        for i in range(0, len(images), batch_size):
            yield normalize_batch(images[i:i + batch_size], cfg), targets[i:i + batch_size], 0
        return
    share = Subset(dataset, range(rank, len(dataset), world)) if world > 1 else dataset
    data = _ReadableItems(share, build_eval_transform(cfg))
    yield from DataLoader(data, batch_size=batch_size, shuffle=False, num_workers=workers,
                          collate_fn=_collate_readable, worker_init_fn=ignore_stop_signals)


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, k: int) -> int:
    """How many labels are among the k highest logits (k is capped at the number of classes)."""
    k = min(k, logits.shape[1])
    return int((logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).sum())


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, cfg: ViTConfig | None = None, batch_size: int = 256,
             device: torch.device | str = "cpu", autocast_dtype: torch.dtype | None = None, rank: int = 0,
             world: int = 1, workers: int = 0, progress: bool | None = False,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> EvalResult:
    """Evaluate `model` (its own `cfg` by default) on `dataset`; see EvalResult. `loss_fn(logits, labels)` is
    the batch's mean loss, softmax cross-entropy by default (a training run passes its own, so that its train
    and val losses are one quantity). `progress`: a progress bar on stderr (None: only where stderr is a
    terminal)."""
    cfg = cfg or model.cfg
    loss_fn = loss_fn or F.cross_entropy
    device = torch.device(device)
    k = cfg.num_classes
    was_training = model.training
    model.eval()
    confusion = torch.zeros(k, k, dtype=torch.int64)
    sums = torch.zeros(4, dtype=torch.float64)  # loss sum, top-5 correct, count, skipped
    batches = eval_batches(dataset, cfg, batch_size, rank, world, workers)
    if progress is not False:
        from tqdm import tqdm

        batches = tqdm(batches, total=-(-len(dataset) // (batch_size * world)), desc="eval", leave=False,
                       disable=None if progress is None else False)
    for x, y, skipped in batches:
        sums[3] += skipped
        if x is None:
            continue
        x, y = x.to(device, non_blocking=True), torch.as_tensor(y).to(device)
        ctx = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype
               else contextlib.nullcontext())
        with ctx:
            logits = model(x)
        logits = logits.float()
        if logits.shape[1] != k:
            raise ValueError(f"the model has {logits.shape[1]} outputs but the config says {k} classes")
        if int(y.max()) >= k:
            raise ValueError(f"the data has label {int(y.max())} but the model only {k} classes")
        sums[0] += loss_fn(logits, y).item() * len(y)
        sums[1] += topk_correct(logits, y, 5)
        sums[2] += len(y)
        confusion += torch.bincount(y.cpu() * k + logits.argmax(1).cpu(), minlength=k * k).view(k, k)
    all_reduce_sum(confusion)
    all_reduce_sum(sums)
    model.train(was_training)
    n, skipped = int(sums[2]), int(sums[3])
    if n == 0:
        raise ValueError("the evaluation set is "
                         f"empty{f': all {skipped} of its images are unreadable' if skipped else ''}")
    names = list(getattr(dataset, "classes", []) or getattr(model, "class_names", None) or [])
    return EvalResult(top1=float(confusion.diag().sum()) / n, top5=float(sums[1]) / n,
                      loss=float(sums[0]) / n,
                      count=n, confusion=confusion, class_names=names if len(names) == k else [],
                      skipped=skipped)


def confusion_png(result: EvalResult, path: str | Path, title: str = "") -> Path | None:
    """Draw the confusion matrix, rows normalised to the true class, counts written in the cells when few.
    Returns the path, or None (with a warning that names the extra) where matplotlib is not installed."""
    if not available("matplotlib"):
        warnings.warn(f"{Path(path).name} not drawn: {install_hint('matplotlib')}", RuntimeWarning,
                      stacklevel=2)
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cm = result.confusion.double()
    k = cm.shape[0]
    rates = cm / cm.sum(dim=1, keepdim=True).clamp(min=1)
    names = result.class_names or [str(i) for i in range(k)]
    size = min(4 + 0.45 * k, 30)
    fig, ax = plt.subplots(figsize=(size, size * 0.9))
    im = ax.imshow(rates.numpy(), cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="fraction of the true class")
    if k <= 30:
        ax.set_xticks(range(k), names, rotation=45, ha="right")
        ax.set_yticks(range(k), names)
        for i in range(k):
            for j in range(k):
                if cm[i, j] > 0:
                    ax.text(j, i, f"{int(cm[i, j])}", ha="center", va="center", fontsize=7,
                            color="white" if rates[i, j] > 0.5 else "black")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title or f"top-1 {100 * result.top1:.2f} % on {result.count} images")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
