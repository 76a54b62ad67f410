"""The training losses (vitkit.train.losses) against the formulas written out again: softmax cross-entropy as
torch's, and the sigmoid cross-entropy of the paper's ImageNet-21k pre-training as big_vision's sigmoid_xent
(-sum over classes of t log s(x) + (1 - t) log s(-x), mean over the batch)."""

from __future__ import annotations

import csv
import math

import pytest
import torch
import torch.nn.functional as F

import vitkit
from train_helpers import synthetic_dataset
from vitkit.data.transforms import normalize_batch
from vitkit.train import get_recipe, train
from vitkit.train.losses import classification_loss, targets


def sigmoid_xent(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """big_vision's sigmoid_xent, element by element in float64."""
    total = 0.0
    for row, trow in zip(logits.double().tolist(), t.double().tolist(), strict=True):
        for x, y in zip(row, trow, strict=True):
            log_p = -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))
            log_not_p = log_p - x
            total -= y * log_p + (1 - y) * log_not_p
    return torch.tensor(total / len(logits), dtype=torch.float64)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_sigmoid_loss_is_big_visions_sigmoid_xent(smoothing):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=g) * 8  # large logits: the log-sigmoid must stay finite
    labels = torch.tensor([0, 4, 2, 2, 1, 3])
    loss = classification_loss("sigmoid", smoothing)(logits, labels)
    t = F.one_hot(labels, 5).double() * (1 - smoothing) + smoothing / 5
    torch.testing.assert_close(loss.double(), sigmoid_xent(logits, t), rtol=1e-5, atol=1e-6)
    soft = torch.softmax(torch.randn(6, 5, generator=g), -1)  # MixUp/CutMix targets are taken as they are
    torch.testing.assert_close(classification_loss("sigmoid")(logits, soft).double(),
                               sigmoid_xent(logits, soft), rtol=1e-5, atol=1e-6)


def test_softmax_loss_is_torchs_cross_entropy_in_fp32():
    logits = torch.randn(4, 3, dtype=torch.bfloat16)
    labels = torch.tensor([2, 0, 1, 1])
    loss = classification_loss("softmax", 0.2)(logits, labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), labels, label_smoothing=0.2))


def test_targets_and_unknown_loss():
    torch.testing.assert_close(targets(torch.tensor([1]), 4, 0.4), torch.tensor([[0.1, 0.7, 0.1, 0.1]]))
    with pytest.raises(ValueError, match="loss='hinge'"):
        classification_loss("hinge")
    with pytest.raises(ValueError, match="loss='hinge'"):
        get_recipe("demo", ["optim.loss=hinge"])


def test_a_sigmoid_run_trains_from_a_minus_ten_bias(tmp_path):
    """The pre-training loss in the loop: the first loss is what the -10 bias predicts (about K * 1e-4 + 10
    per image when the zero-initialised classifier leaves the logits at the bias), and training lowers it."""
    data = synthetic_dataset(64, seed=3, size=16)
    cfg = get_recipe("demo-tiny", ["optim.loss=sigmoid", "optim.head_bias=-10", "threads=1", "steps=12",
                                   "optim.lr=0.01", "optim.warmup_steps=0", "optim.label_smoothing=0",
                                   "log_every=1", "ema=0"])
    train(cfg, tmp_path / "run", train_set=data, val_set=data, progress=False)
    with (tmp_path / "run" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["loss"]) for r in rows if r["split"] == "train"]
    k = len(data.classes)
    assert (losses[0]
            == pytest.approx((k - 1) * math.log1p(math.exp(-10)) + math.log1p(math.exp(10)), rel=1e-3))
    assert losses[-1] < losses[0] - 1
    # The validation loss is the same quantity as the training loss: the sigmoid loss of the last weights.
    last = vitkit.load(tmp_path / "run" / "last")
    with torch.no_grad():
        logits = last(normalize_batch(data.images, last.cfg))
    val = [float(r["loss"]) for r in rows if r["split"] == "val"][-1]
    assert val == pytest.approx(sigmoid_xent(logits, F.one_hot(data.targets, k).float()).item(), rel=1e-4)
