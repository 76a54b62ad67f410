"""Training configuration as code: typed dataclasses, recipes as functions that return them, and `--set`
overrides with dotted keys that are type-checked (unknown keys are rejected with the list of valid ones).

A recipe's docstring gives the command that runs it and the result it reaches. Every recipe has a tiny twin
(`NAME-tiny`) that runs in seconds on a CPU, for tests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..config import (
    POSEMB_MODES,
    TRAINING_RATES,
    PosembMode,
    ViTConfig,
    gap_drops_class_token,
    get_config,
    is_finite_number,
    is_integer,
)
from ..data.augment import AugmentConfig

Optimizer = Literal["adamw", "sgd"]
Schedule = Literal["cosine", "linear", "constant"]
Precision = Literal["auto", "fp32", "bf16", "bf16-native"]
Loss = Literal["softmax", "sigmoid"]


# --- checking values ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: finite (an integer when `integer`), from `low` to `high`, each end
    included unless `open_low`/`open_high`. Checked before the settings' other checks because nan and infinity
    slip through comparisons (`nan < 0` is false) and would fail only mid-run, far from the key that caused it."""

    low: float = -math.inf
    high: float = math.inf
    integer: bool = False
    open_low: bool = False
    open_high: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        if self.high == math.inf:
            return kind if self.low == -math.inf else f"{kind} {'>' if self.open_low else '>='} {_fmt(self.low)}"
        return (f"{kind} in {'(' if self.open_low else '['}{_fmt(self.low)}, {_fmt(self.high)}"
                f"{')' if self.open_high else ']'}")

    def admits(self, value: Any) -> bool:
        if not (is_integer if self.integer else is_finite_number)(value):
            return False
        above = value > self.low if self.open_low else value >= self.low
        below = value < self.high if self.open_high else value <= self.high
        return above and below


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def range_errors(obj: Any, ranges: dict[str, Range]) -> list[str]:
    """One message per field of `obj` outside its Range (a tuple's every item must be inside), naming the key."""
    errors = []
    for key, r in ranges.items():
        value = getattr(obj, key)
        items = value if isinstance(value, tuple) else (value,)
        if not all(r.admits(v) for v in items):
            errors.append(f"{key}={value!r} (need {r.describe()}{' each' if isinstance(value, tuple) else ''})")
    return errors


def nonfinite_errors(obj: Any, prefix: str) -> list[str]:
    """The float fields (and floats in tuple fields) of a settings dataclass that are nan or infinite. For the
    groups whose own checks live elsewhere (`augment`), where `mixup=nan` would pass `mixup < 0` unseen."""
    errors = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        items = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            errors.append(f"{prefix}{f.name}={value!r} (need a finite number)")
    return errors


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?|mps")


def device_error(name: Any) -> str | None:
    """Why `name` is not a device a run can ask for (None when it is): auto, cpu, cuda, cuda:N, and mps where
    this torch was built with it. Whether the machine has that device is checked when the run starts."""
    if not isinstance(name, str) or not _DEVICE.fullmatch(name):
        return f"device={name!r} (choose from auto, cpu, cuda, cuda:N, mps)"
    if name == "mps" and not _mps_built():
        return "device='mps' (this torch is built without MPS; choose from auto, cpu, cuda, cuda:N)"
    return None


def _mps_built() -> bool:
    import torch

    return torch.backends.mps.is_built()


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer, learning-rate schedule and loss settings.

    `lr` is the peak learning rate for the global batch. The schedule: linear warm-up from 0 over
    `warmup_steps` (or `warmup_epochs`, whichever is set), then `schedule` down towards `min_lr`, which the step
    after the last would take (vitkit.train.optim.lr_at).
    `weight_decay` is decoupled (AdamW; the paper's Flax Adam is the same) and applies only to weights of 2 or
    more dimensions, never to biases, norms, the position embedding or the class token.
    `clip_grad_norm`: clip the global gradient norm to this value (0: off).
    `loss`: 'softmax' cross-entropy, or 'sigmoid': a binary cross-entropy per class, summed over the classes (the
    paper's ImageNet-21k pre-training; see vitkit.train.losses). `label_smoothing` applies to either.
    `head_bias`: the value the new classifier's bias starts at (the paper's pre-training: -10 with the sigmoid
    loss; 0 otherwise, as the zero-initialised fine-tuning head).
    """

    name: Optimizer = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.9  # SGD only
    schedule: Schedule = "cosine"
    warmup_steps: int = 0
    warmup_epochs: float = 0.0
    min_lr: float = 0.0
    clip_grad_norm: float = 0.0
    label_smoothing: float = 0.0
    loss: Loss = "softmax"
    head_bias: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        errors = range_errors(self, OPTIM_RANGES)
        if errors:  # the checks below compare these
            raise ValueError("invalid optim settings: " + "; ".join(errors))
        if self.name not in typing.get_args(Optimizer):
            errors.append(f"name={self.name!r} (choose from {', '.join(typing.get_args(Optimizer))})")
        if self.schedule not in typing.get_args(Schedule):
            errors.append(f"schedule={self.schedule!r} (choose from {', '.join(typing.get_args(Schedule))})")
        if self.loss not in typing.get_args(Loss):
            errors.append(f"loss={self.loss!r} (choose from {', '.join(typing.get_args(Loss))})")
        if not math.isfinite(self.head_bias):
            errors.append(f"head_bias={self.head_bias!r} (need a finite number)")
        if self.min_lr > self.lr:
            errors.append(f"lr={self.lr}, min_lr={self.min_lr} (need 0 <= min_lr <= lr, lr > 0)")
        if self.warmup_steps and self.warmup_epochs:
            errors.append("set warmup_steps or warmup_epochs, not both")
        if errors:
            raise ValueError("invalid optim settings: " + "; ".join(errors))


OPTIM_RANGES = {
    "lr": Range(0, open_low=True), "weight_decay": Range(0), "betas": Range(0, 1, open_high=True),
    "eps": Range(0, open_low=True), "momentum": Range(0, 1, open_high=True), "warmup_steps": Range(0, integer=True),
    "warmup_epochs": Range(0), "min_lr": Range(0), "clip_grad_norm": Range(0), "label_smoothing": Range(0, 1, open_high=True),
}


@dataclass(frozen=True)
class DataConfig:
    """What to train and evaluate on.

    `name`: a dataset name (fashion-mnist, cifar10, cifar100) or a folder of class sub-folders (see
    `vitkit.data.resolve`). `val_split`: evaluated during training ('' for none). `limit`/`val_limit`: use
    only N images (0: all), for quick runs, spread evenly over the split so that a folder's classes all keep
    their share (vitkit.data.subsets). `workers`: DataLoader processes, used for datasets that
    are not held in memory (image folders); in-memory datasets are augmented whole batches at a time.
    """

    name: str = "fashion-mnist"
    data_dir: str | None = None
    train_split: str = "train"
    val_split: str = "test"
    download: bool = True
    skip_bad_images: bool = False
    limit: int = 0
    val_limit: int = 0
    workers: int = 0
    eval_batch_size: int = 500

    def __post_init__(self) -> None:
        errors = range_errors(self, DATA_RANGES)
        if errors:
            raise ValueError("invalid data settings: " + "; ".join(errors))


DATA_RANGES = {"limit": Range(0, integer=True), "val_limit": Range(0, integer=True), "workers": Range(0, integer=True),
               "eval_batch_size": Range(1, integer=True)}


@dataclass(frozen=True)
class TrainConfig:
    """A whole training run. `batch_size` is the global batch (all processes, all accumulation steps);
    `micro_batch` is what one process puts through the model at once (0: batch_size / processes, i.e. no
    gradient accumulation). Length: `steps` if set, else `epochs` (fractions allowed).

    `init`: a checkpoint or model name to fine-tune from (the head is replaced for the data's classes and the
    position embedding resampled to `model.image_size`, Sec. 3.2); empty: train `model` from scratch.
    `posemb_interpolation`: how that resampling interpolates (vitkit.posemb.resample_pos_embed): 'bicubic' with
    antialiasing as timm, 'bilinear', or 'bilinear-corners' as the paper's code (scipy.ndimage.zoom, order 1).
    `full_token_epochs`: with PatchDropout (`model.patch_dropout`), the last this-many epochs train on every
    patch token, so that training ends on the token count the model is evaluated with (FLIP's "unmasked
    tuning", Li et al. 2023); 0: PatchDropout to the end. Without PatchDropout it changes nothing.
    `ema`: decay of an exponential moving average of the weights (0: off); when on, evaluation and the saved
    models use the averaged weights. `precision`: 'auto' is bf16 autocast on CUDA and fp32 on a CPU;
    'bf16-native' also takes bf16 on CPUs that compute it in hardware (AVX512-BF16, AMX), fp32 on others.
    `eval_every`, `ckpt_every`: in steps (0: at the end of every epoch). `keep_last`: training-state checkpoints
    kept (the best and the last models are kept apart, as vitkit checkpoints).
    `compile`: train through `torch.compile` (inductor; evaluation stays eager). The first steps wait for the
    compilation (about 30 s on our CPU, again when PatchDropout turns off); then, measured step for step: the
    `fashion-mnist` recipe's training step (one process, one thread, bf16 autocast) 1.12x on our CPU, ViT-S/16's
    0.96x there (inductor's matrix products replace oneDNN's), ViT-B/16's 1.24-1.34x on an H200
    (benchmarks/bench_gpu.py's step, outside this loop). Off by default: on our CPU it barely pays back its
    compilation.
    """

    recipe: str = ""
    model: ViTConfig = field(default_factory=ViTConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=lambda: AugmentConfig(crop="none", hflip=0.0))
    init: str = ""
    posemb_interpolation: PosembMode = "bicubic"
    epochs: float = 10.0
    steps: int = 0
    full_token_epochs: float = 0.0
    batch_size: int = 128
    micro_batch: int = 0
    ema: float = 0.0
    seed: int = 0
    precision: Precision = "auto"
    device: str = "auto"
    threads: int = 0
    eval_every: int = 0
    ckpt_every: int = 0
    keep_last: int = 2
    log_every: int = 20
    deterministic: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        errors = range_errors(self, TRAIN_RANGES) + nonfinite_errors(self.augment, "augment.")
        if self.precision not in typing.get_args(Precision):
            errors.append(f"precision={self.precision!r} (choose from {', '.join(typing.get_args(Precision))})")
        if self.posemb_interpolation not in POSEMB_MODES:
            errors.append(f"posemb_interpolation={self.posemb_interpolation!r} "
                          f"(choose from {', '.join(POSEMB_MODES)})")
        if device_error(self.device):
            errors.append(device_error(self.device))
        if errors:  # the checks below compare and divide these
            raise ValueError("invalid training config: " + "; ".join(errors))
        if self.micro_batch and self.batch_size % self.micro_batch:
            errors.append(f"batch_size={self.batch_size} is not a multiple of micro_batch={self.micro_batch}")
        if self.steps == 0 and self.epochs == 0:
            errors.append("set steps > 0 or epochs > 0")
        if errors:
            raise ValueError("invalid training config: " + "; ".join(errors))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model"] = self.model.to_dict()
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        return _from_dict(cls, d, "")


# `ema` is a decay (0 is off); `seed` feeds numpy's seed, which takes 32 bits; the `*_every` 0 means "every epoch".
TRAIN_RANGES = {
    "epochs": Range(0), "steps": Range(0, integer=True), "full_token_epochs": Range(0),
    "batch_size": Range(1, integer=True), "micro_batch": Range(0, integer=True), "ema": Range(0, 1, open_high=True),
    "seed": Range(0, 2**32, integer=True, open_high=True), "threads": Range(0, integer=True),
    "eval_every": Range(0, integer=True), "ckpt_every": Range(0, integer=True), "keep_last": Range(1, integer=True),
    "log_every": Range(1, integer=True),
}


# --- recipes ------------------------------------------------------------------------------------------------
def pretrain() -> TrainConfig:
    """Pre-training on ImageNet-21k as in the paper (Sec. 4.1; Appendix B.1, Table 3's ImageNet-21k row): ViT-B/16
    at 224 px with the pre-training head (one tanh hidden layer), Adam (b1 0.9, b2 0.999) with decoupled weight
    decay 0.03 (as Flax's Adam: lr x wd x weight per step), dropout 0.1, batch 4096, learning rate 1e-3 with a
    linear warm-up over 10k steps then linear decay, gradient clipping at global norm 1, 90 epochs. The loss is
    a sigmoid cross-entropy per class with the classifier's bias started at -10, as the authors trained on this
    multi-label dataset (google-research/vision_transformer issue 2; big_vision's configs/vit_i21k.py). Batch
    4096 runs as 64 accumulation steps of 64 images (divided among the processes).

        vitkit train pretrain --out runs/pretrain --set data.name=/data/imagenet21k
        torchrun --nproc_per_node 8 -m vitkit.cli.main train pretrain --out runs/pretrain --set ...

    Needs an ImageNet-sized folder and days of accelerators; fine-tuned on ImageNet at 384 px, the authors'
    code reaches 84.6 % top-1 with such a ViT-B/16 (its README); not reproduced here. Table 3's JFT-300M row
    differs: weight decay 0.1, no dropout, 7 epochs, lr 8e-4.
    """
    return TrainConfig(
        recipe="pretrain",
        model=get_config("ViT-B/16", representation_size=768, num_classes=1000, dropout=0.1),
        optim=OptimConfig(name="adamw", lr=1e-3, weight_decay=0.03, betas=(0.9, 0.999), schedule="linear",
                          warmup_steps=10_000, clip_grad_norm=1.0, loss="sigmoid", head_bias=-10.0),
        data=DataConfig(name="", val_split="val", workers=8),
        augment=AugmentConfig(crop="rrc", hflip=0.5),
        epochs=90.0, batch_size=4096, micro_batch=64, ckpt_every=5000, eval_every=5000,
    )


def finetune() -> TrainConfig:
    """Fine-tuning as in the paper (Sec. 4.1, Appendix B.1.1) and its code (vit_jax): SGD with momentum 0.9, no
    weight decay, gradient clipping at global norm 1, batch 512, 500 warm-up steps then cosine decay, lr 0.003
    (the paper sweeps 0.001-0.03), 10k steps (the CIFAR setting), at 384 px; training crops of 5 % to 100 % of
    the image (vit_jax's `sample_distorted_bounding_box` area range) and flips; the position table resampled
    as vit_jax does (`posemb_interpolation='bilinear-corners'`). Batch 512 runs as accumulation steps of 32
    images. `init` names the pre-trained checkpoint (anything `vitkit.load` reads).

        vitkit train finetune --out runs/ft --set init=path/to/vit_b16 --set data.name=cifar10

    With the ImageNet-21k ViT-B/16 this setting reaches 98.9 % and 99.0 % on CIFAR-10 in the authors' two runs
    (vision_transformer's README); not reproduced on our CPUs.
    """
    return TrainConfig(
        recipe="finetune",
        model=get_config("ViT-B/16", image_size=384, num_classes=10),
        optim=OptimConfig(name="sgd", lr=0.003, weight_decay=0.0, momentum=0.9, schedule="cosine",
                          warmup_steps=500, clip_grad_norm=1.0),
        data=DataConfig(name="cifar10", val_split="test", workers=4),
        augment=AugmentConfig(crop="rrc", crop_scale=(0.05, 1.0), hflip=0.5),
        init="", posemb_interpolation="bilinear-corners", steps=10_000, batch_size=512, micro_batch=32,
        ckpt_every=500, eval_every=1000,
    )


def fashion_mnist_vit(depth: int, name: str, patch: int = 7, dim: int = 128, mlp_dim: int = 256,
                      patch_dropout: float = 0.0, attn_init: str = "xavier") -> ViTConfig:
    """The small pure ViT of the Fashion-MNIST recipes: 28x28 grey images cut into `patch` x `patch` patches,
    4 heads, normalised with the training set's mean and std."""
    return ViTConfig(image_size=(28, 28), patch_size=patch, in_chans=1, num_classes=10, dim=dim, depth=depth,
                     num_heads=4, mlp_dim=mlp_dim, patch_dropout=patch_dropout, attn_init=attn_init,
                     mean=(0.2860,), std=(0.3530,),
                     interpolation="bilinear", crop_pct=1.0, name=name)


def fashion_mnist() -> TrainConfig:
    """Our from-scratch pure ViT for Fashion-MNIST within 30 minutes on 2 CPU cores (benchmarks/fashion_mnist.py):
    4x4 patches (49 tokens + class token), width 64, depth 6, 4 heads, MLP 128 (206k parameters), its attention
    initialised mimetically (`model.attn_init`: W_q W_k^T near +I, W_v W_o near -I); in training
    each image keeps a random half of its patch tokens (PatchDropout, `model.patch_dropout` 0.5) except in the
    last epoch, which sees them all (`full_token_epochs`); AdamW lr 4e-3, batch 256, weight decay 0.05, 2
    epochs of warm-up then cosine, label smoothing 0.1; a random crop after 2 pixels of padding, flips and
    random erasing (p 0.25); EMA of the weights; 90 epochs; the test set evaluated every 3 epochs. bf16 autocast
    where the CPU computes bf16 natively (`precision="bf16-native"`: AVX512-BF16 or AMX, as on our AMD EPYC; fp32
    elsewhere), with the attention matrices kept in fp32. Run it as two processes of one thread each
    (`--nproc 2`): on 2 cores that is 1.25-1.35x faster than one process of two threads, whose small matrix
    products parallelise poorly.

        vitkit train fashion-mnist --out runs/fmnist --nproc 2
        .venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/fashion_mnist.py --out runs/bench-fmnist

    How we got here (benchmarks/fashion_mnist.py, test top-1; compute is the budget on our CPU). Every figure
    below predates session 24's initialisation of the class token (now zeros) and position embedding (now
    normal 0.02, not truncated), as the Flax code has them; the runs were not repeated since.
    - 16 tokens overfit: 7x7 patches, width 128, no crop, 25 epochs: 90.25 % in 21.5 min, with the test loss
      rising from epoch 20 on and the training loss still falling.
    - At equal time (about 6 minutes, 2 cores, no crop) small patches need a narrow model: 7x7/width 128
      87.61 %; 4x4/width 64 87.51 %; 4x4/width 96 86.76 %; 4x4/width 128 85.56 % (2.7 epochs).
    - With the crop and erasing, two runs side by side on one core each: 4x4/width 64 was at 88.49 % after
      13 of 28 epochs, 7x7/width 128 at 87.78 % after 16 of 30; the augmented runs start slower (72.9 % and
      61.6 % after one epoch) and keep climbing where the unaugmented one stalls.
    - All 50 tokens, 26 epochs: 90.79 % in 26.7 min; 29 epochs (with the faster attention of the training
      step): 91.11 % in 31.8 min. Tried and dropped: depth 7 (no better per epoch, 1.13x slower); batch 64
      (lr 1.5e-3; no better per epoch, slower per epoch); fine-tuning 2 epochs at 36 px (81 tokens, Sec. 3.2)
      after the 29 epochs: 90.83 %, below the 91.11 % it started from; MLP ratio 4 and GAP: no gain.
    - PatchDropout (lr 2e-3, batch 128, one process): 0.25, 35 epochs: 91.32 % in 29.0 min; 0.5, 45 epochs:
      91.82 % in 26.0 min.
    - 12-epoch runs side by side on one core each (lr 2e-3, PatchDropout 0.5: 86.54 %): sincos-2d positions
      86.34 % (ahead until epoch 9, then behind); all tokens in the last epoch 86.87 %, and with that: no
      random erasing 86.55 %, lr 3e-3 87.39 %; PatchDropout 0.75 for 17 epochs and one with all tokens (about
      the same time) 87.13 %.
    - Two processes of one thread, lr 3e-3, batch 128, 50 epochs (the last with all tokens): 92.23 % in
      24.3 min. Batch 256 is another 1.22x faster per image with two processes (2,900 vs 2,380 img/s).
    - The recipe with PatchDropout 0.75, 90 epochs, the last 2 with all tokens: 91.77 % in 26.4 min (behind the
      recipe at every point in time: 90.82 % vs ~91.5 % after 17 min; the 2 full-token epochs added nothing).

    - With the Flax (Xavier) attention initialisation: 92.48 % in 25.4 min; 85 % after 4.6 min, 90 % after
      11.3 min, 92 % after 20.3 min.
    - Mimetic initialisation, 12-epoch runs side by side (lr 4e-3, batch 256; Xavier 86.81 %): 88.39 %, ahead
      from the fourth epoch on; with the fixed sine-cosine positions 87.89 %; with the learned table started
      at the sine-cosine one 87.60 %; with 2 heads of 32 87.92 %; with lr 6e-3 87.98 %; weight decay 0.1
      88.23 %, random erasing p 0.5 88.42 % (both within the noise).
    - Mimetic, 72 epochs: 92.76 % in 30.3 min (the machine slowed down in the last 10 minutes; 92.68 % after
      69 epochs): no better than 66. Mimetic with lr 3e-3, 66 epochs: 92.45 % (31.3 min in a slow phase of the
      machine; level with lr 4e-3 until epoch 36, then behind).

    - fp32, 66 epochs (the recipe before bf16): 92.76 % test top-1 in 24.6 min; 85 % after 3.6 min, 90 % after
      10.1 min, 92 % after 18.9 min (ahead of the Xavier initialisation at every evaluation: 91.02 vs 90.66 %
      after 36 epochs).
    - bf16 autocast (one core's training step 1.6x faster, 1.24x per epoch with two processes), 12-epoch runs
      side by side (fp32 88.39 %): everything in bf16 87.78 %; the softmax in fp32 87.72 %; the attention's
      logits and softmax in fp32 88.13 % (the model's choice; 1.14x slower than the fp32 softmax alone). All
      bf16 with width 80 and MLP 160: 87.66 % (1.2x slower per step than width 64).

    Measured, the full recipe (`torchrun --standalone --nproc_per_node 2 benchmarks/fashion_mnist.py --set
    precision=bf16-native --set epochs=90`, the recipe's values): 93.29 % test top-1 (93.24 % for the saved model
    evaluated in fp32) in 26.2 min; 85 % after 2.8 min, 90 % after 8.9, 92 % after 17.4, 93 % after 22.5. With
    `--set seed=1`: 93.22 % (93.19 % in fp32) in 28.6 min (the machine slowed down in the last third), 93 % after
    25.0 min. With more time, `--set epochs=150`: 93.59 % (93.61 % in fp32) in 52.7 min (a slow phase of the
    machine throughout, ~2,500 img/s).
    """
    return TrainConfig(
        recipe="fashion-mnist",
        model=fashion_mnist_vit(depth=6, name="vit-fashion-mnist", patch=4, dim=64, mlp_dim=128,
                                patch_dropout=0.5, attn_init="mimetic"),
        optim=OptimConfig(name="adamw", lr=4e-3, weight_decay=0.05, schedule="cosine", warmup_epochs=2.0,
                          clip_grad_norm=1.0, label_smoothing=0.1),
        data=DataConfig(name="fashion-mnist", val_split="test"),
        augment=AugmentConfig(crop="pad-crop", pad=2, hflip=0.5, random_erasing=0.25),
        # eval_every: every 3 epochs of Fashion-MNIST's 60,000 training images at batch 256 (a step count: it
        # is not rescaled when data.limit or batch_size is changed).
        epochs=90.0, full_token_epochs=1.0, batch_size=256, ema=0.999, eval_every=3 * (60_000 // 256),
        log_every=50, precision="bf16-native",
    )


def demo() -> TrainConfig:
    """What `make demo` trains: a small ViT with 7x7 patches (16 tokens), width 128, depth 4, on Fashion-MNIST
    for 6 epochs (2,808 steps of 128): about 5 minutes on 2 free CPU cores, 85 % or more on the test set.
    Flips only: in a run this short a random crop slows learning more than it regularises (73 % vs 78 % after
    the first epoch, 82.2 % vs 84.7 % after the third, in two 5-epoch runs).

        vitkit train demo --out runs/demo

    Measured: `make demo` on a fresh clone, 2 free cores: trained in 173 s (~2,400 img/s), 87.52 % test top-1,
    4.5 min for the whole demo with set-up. (88.39 % in another run, 1 thread on a shared machine, 18.7 min.)
    With the Flax initialisation of the class token and positions (session 24), on our slower Intel machine:
    87.72 %, 99.73 % top-5, 2,808 steps in 6.4 min.
    The mimetic attention initialisation that helps the `fashion-mnist` recipe does not help this 4x4 grid of
    tokens: 87.62 % vs 87.96 % with Xavier, two runs side by side on one core each.
    """
    return TrainConfig(
        recipe="demo",
        model=fashion_mnist_vit(depth=4, name="vit-fashion-mnist-demo"),
        optim=OptimConfig(name="adamw", lr=2e-3, weight_decay=0.05, schedule="cosine", warmup_epochs=0.5,
                          clip_grad_norm=1.0, label_smoothing=0.1),
        data=DataConfig(name="fashion-mnist", val_split="test"),
        augment=AugmentConfig(crop="none", hflip=0.5),
        epochs=6.0, batch_size=128, log_every=50,
    )


def _tiny_model(cfg: ViTConfig, image_size: int, patch: int) -> ViTConfig:
    """The same kind of model, shrunk to run in a fraction of a second per step."""
    return cfg.replace(image_size=(image_size, image_size), patch_size=patch, dim=32, depth=2, num_heads=2,
                       mlp_dim=64, representation_size=32 if cfg.representation_size else None,
                       name=(cfg.name or "vit") + "-tiny")


def _tiny(cfg: TrainConfig, image_size: int, patch: int, batch: int = 32, micro: int = 0) -> TrainConfig:
    """A recipe's tiny twin: tiny model, a few hundred images, a few dozen steps, checkpoints every 4 steps."""
    return dataclasses.replace(
        cfg, recipe=cfg.recipe + "-tiny", model=_tiny_model(cfg.model, image_size, patch),
        optim=dataclasses.replace(cfg.optim, warmup_steps=2 if cfg.optim.warmup_steps or cfg.optim.warmup_epochs
                                  else 0, warmup_epochs=0.0),
        data=dataclasses.replace(cfg.data, limit=256, val_limit=128, workers=0, eval_batch_size=128),
        epochs=0.0, steps=16, batch_size=batch, micro_batch=micro, ckpt_every=4, eval_every=8, log_every=4,
        ema=cfg.ema and 0.9,
    )


def pretrain_tiny() -> TrainConfig:
    """pretrain's twin on 16x16 Fashion-MNIST: tiny model, gradient accumulation (batch 32 as 4 x 8)."""
    base = pretrain()
    cfg = _tiny(base, 16, 4, batch=32, micro=8)
    return dataclasses.replace(cfg, model=cfg.model.replace(in_chans=1, num_classes=10),
                               data=dataclasses.replace(cfg.data, name="fashion-mnist", val_split="test"))


def finetune_tiny() -> TrainConfig:
    """finetune's twin: needs `init` (e.g. a tiny checkpoint); batch 16 as 2 x 8 at 16x16."""
    base = finetune()
    cfg = _tiny(base, 16, 4, batch=16, micro=8)
    return dataclasses.replace(cfg, model=cfg.model.replace(in_chans=1, num_classes=10),
                               data=dataclasses.replace(cfg.data, name="fashion-mnist"))


def fashion_mnist_tiny() -> TrainConfig:
    return _tiny(fashion_mnist(), 28, 4)


def demo_tiny() -> TrainConfig:
    return _tiny(demo(), 28, 7)


RECIPES: dict[str, Callable[[], TrainConfig]] = {
    "pretrain": pretrain,
    "finetune": finetune,
    "fashion-mnist": fashion_mnist,
    "demo": demo,
    "pretrain-tiny": pretrain_tiny,
    "finetune-tiny": finetune_tiny,
    "fashion-mnist-tiny": fashion_mnist_tiny,
    "demo-tiny": demo_tiny,
}


# Recipes that fine-tune: without `init` they would train their model from scratch, which they are not made for.
NEEDS_INIT = ("finetune", "finetune-tiny")


def missing_init(cfg: TrainConfig) -> str | None:
    """Why `cfg` cannot run as it is (a fine-tuning recipe without `init`), or None."""
    if cfg.recipe in NEEDS_INIT and not cfg.init:
        return (f"the {cfg.recipe} recipe fine-tunes a pre-trained model: set init=CHECKPOINT (anything vitkit.load "
                "reads, e.g. --set init=ViT-B_16.npz); to train from scratch, use pretrain, fashion-mnist or demo")
    return None


def get_recipe(name: str, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """The recipe `name` with `--set key=value` overrides applied."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    return apply_overrides(RECIPES[name](), overrides)


# --- --set key=value --------------------------------------------------------------------------------------
def valid_keys(cls: type = TrainConfig, prefix: str = "") -> list[str]:
    """Every dotted key `--set` accepts, e.g. 'optim.lr', 'model.dim'."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            keys += valid_keys(t, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


# Short names for the keys a fine-tuning command line sets most (`--set image_size=384 --set data=cifar10`).
ALIASES = {"image_size": "model.image_size", "data": "data.name", "lr": "optim.lr"}


def apply_overrides(cfg: TrainConfig, overrides: list[str] | tuple[str, ...]) -> TrainConfig:
    """Apply `key=value` strings (dotted keys into the nested settings, or one of ALIASES). Values are parsed
    for the field's type; unknown keys and values of the wrong type raise ValueError naming them.

    Every override is applied before the settings are checked, each group rebuilt once with all of its
    changes: the groups check their fields together (pool='gap' needs class_token=False, dim a multiple of
    num_heads, min_lr <= lr), so checking one override at a time would refuse a valid combination or not
    depending on the order of the `--set`s. A later `--set` of the same key wins."""
    changes: dict[str, tuple[Any, str]] = {}  # dotted key -> (parsed value, the item as given)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected key=value, e.g. optim.lr=0.001")
        key, text = (part.strip() for part in item.split("=", 1))
        key = ALIASES.get(key, key)
        changes[key] = (parse_value(text, field_type(key), key), f"{key}={text}")
    # As create_model and get_config: GAP from scratch means no class token (the paper's D.3) unless
    # class_token is set too (timm's GAP that keeps its class token); fine-tuning keeps the checkpoint's.
    init = changes["init"][0] if "init" in changes else cfg.init
    model_changes = {key.removeprefix("model."): value for key, (value, _) in changes.items()
                     if key.startswith("model.")}
    if gap_drops_class_token(model_changes) and not init:
        changes["model.class_token"] = (False, "model.pool=gap")
    # `init` first: the model becomes the checkpoint's architecture, and the model settings set alongside are
    # applied to (and checked against) it rather than the recipe's.
    if "init" in changes:
        cfg = _with_changes(cfg, {"init": changes.pop("init")})
        if cfg.init:
            cfg = dataclasses.replace(cfg, model=init_model_config(cfg.init, cfg.model))
            from ..transfer import SHAPE_FIELDS

            fixed = [item for key, (value, item) in changes.items() if key.startswith("model.")
                     and key[len("model."):] in SHAPE_FIELDS and value != getattr(cfg.model, key[len("model."):])]
            if fixed:
                raise ValueError(f"--set {', '.join(fixed)}: fine-tuning from init={cfg.init} keeps its "
                                 f"architecture, whose weights fix {', '.join(SHAPE_FIELDS)}")
    return _with_changes(cfg, changes)


def field_type(key: str) -> Any:
    """The type of the setting a dotted key names; an unknown key, or a group of settings, raises ValueError."""
    t: Any = TrainConfig
    for name in key.split("."):
        if not dataclasses.is_dataclass(t) or name not in {f.name for f in dataclasses.fields(t)}:
            raise ValueError(f"unknown key {key!r}; valid keys: {', '.join(valid_keys())}")
        t = typing.get_type_hints(t)[name]
    if dataclasses.is_dataclass(t):
        raise ValueError(f"{key!r} is a group of settings; set one of its keys, e.g. {valid_keys(t, key + '.')[0]}")
    return t


def _with_changes(obj: Any, changes: dict[str, tuple[Any, str]]) -> Any:
    """`obj` with `changes` (dotted key below obj -> (value, the `--set` item)) applied: each nested group is
    rebuilt once with all of its changes, then `obj` once with its own and the rebuilt groups, so that each
    dataclass validates the combination. A refusal names the `--set` items of the group that refused."""
    if not changes:
        return obj
    own: dict[str, tuple[Any, str]] = {}
    nested: dict[str, dict[str, tuple[Any, str]]] = {}
    for key, change in changes.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = change
        else:
            own[head] = change
    kwargs = {name: _with_changes(getattr(obj, name), sub) for name, sub in nested.items()}
    kwargs.update({name: value for name, (value, _) in own.items()})
    try:
        return dataclasses.replace(obj, **kwargs)
    except ValueError as e:
        # A group's own items are to blame; with none, one of the nested ones (a check across groups).
        items = [item for _, item in own.values()] or [item for _, item in changes.values()]
        raise ValueError(f"--set {', '.join(items)}: {e}") from None


def init_model_config(init: str, recipe_model: ViTConfig) -> ViTConfig:
    """With `init`, the model is the checkpoint's architecture (its head replaced later for the data's
    classes). The recipe keeps its resolution where the checkpoint's patches tile it (else the checkpoint's
    own), and its training-only rates (dropout, stochastic depth, patch dropout: `TRAINING_RATES`)."""
    from .. import load

    src = load(init).cfg
    size = recipe_model.image_size
    if size[0] % src.patch_stride or size[1] % src.patch_stride:
        size = src.image_size
    return src.replace(image_size=size, representation_size=None,
                       **{k: getattr(recipe_model, k) for k in TRAINING_RATES})


_NONE = ("none", "null", "")


def parse_value(text: str, t: Any, key: str = "value") -> Any:
    """Parse `text` as type `t` (bool, int, float, str, Literal, tuples, X | None)."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.lower() in _NONE:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return parse_value(text, a, key)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{key}={text!r}: cannot parse")
    if origin is Literal:
        if text not in args:
            raise ValueError(f"{key}={text!r}: choose from {', '.join(map(str, args))}")
        return text
    if origin is tuple:
        parts = [p for p in text.replace("x", ",").split(",") if p.strip()] if text else []
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(parse_value(p.strip(), args[0], key) for p in parts)
        if len(parts) == 1 and len(args) > 1:  # "28" for (28, 28)
            parts = parts * len(args)
        if len(parts) != len(args):
            raise ValueError(f"{key}={text!r}: expected {len(args)} comma-separated values")
        return tuple(parse_value(p.strip(), a, key) for p, a in zip(parts, args, strict=True))
    if t is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{key}={text!r}: expected true or false")
    if t is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{key}={text!r}: expected an integer") from None
    if t is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{key}={text!r}: expected a number") from None
    if t is str:
        return text
    raise ValueError(f"{key}: cannot set a value of type {t}")


def _from_dict(cls: type, d: dict[str, Any], prefix: str) -> Any:
    """Rebuild a (nested) settings dataclass from its `to_dict`, rejecting unknown keys."""
    if cls is ViTConfig:
        return ViTConfig.from_dict(d)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown keys {[prefix + k for k in unknown]} in a saved {cls.__name__}")
    kwargs = {}
    for k, v in d.items():
        t = hints[k]
        if dataclasses.is_dataclass(t):
            kwargs[k] = _from_dict(t, v, prefix + k + ".")
        elif typing.get_origin(t) is tuple or tuple in typing.get_args(t) or isinstance(v, list):
            kwargs[k] = tuple(v) if isinstance(v, list) else v
        else:
            kwargs[k] = v
    return cls(**kwargs)
