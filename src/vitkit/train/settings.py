"""The settings of a training run as typed, frozen dataclasses (`TrainConfig` and its groups `OptimConfig`,
`DataConfig`), each checked when it is built: a value out of its range, or a combination that cannot run,
raises ValueError naming the keys. `TrainConfig.to_json`/`from_dict` write and read a run's config.json.

The recipes that fill these in are in vitkit.train.recipes; `--set key=value` overrides in
vitkit.train.overrides.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from ..config import POSEMB_MODES, PosembMode, ViTConfig, choice_errors, is_finite_number, is_integer
from ..data.augment import AugmentConfig

Optimizer = Literal["adamw", "sgd"]
Schedule = Literal["cosine", "linear", "constant"]
Precision = Literal["auto", "fp32", "bf16", "bf16-native"]
Loss = Literal["softmax", "sigmoid"]
Parallel = Literal["ddp", "fsdp"]


# --- checking values ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: finite (an integer when `integer`), from `low` to `high`, each
    end included unless `open_low`/`open_high`. Checked before the settings' other checks because nan and
    infinity slip through comparisons (`nan < 0` is false) and would fail only mid-run, far from the key that
    caused it."""

    low: float = -math.inf
    high: float = math.inf
    integer: bool = False
    open_low: bool = False
    open_high: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        if self.high == math.inf:
            return (kind if self.low == -math.inf
                    else f"{kind} {'>' if self.open_low else '>='} {_fmt(self.low)}")
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
    """One message per field of `obj` outside its Range (a tuple's every item must be inside), naming the
    key."""
    errors = []
    for key, r in ranges.items():
        value = getattr(obj, key)
        items = value if isinstance(value, tuple) else (value,)
        if not all(r.admits(v) for v in items):
            errors.append(f"{key}={value!r} (need "
                          f"{r.describe()}{' each' if isinstance(value, tuple) else ''})")
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
    `warmup_steps` (or `warmup_epochs`, whichever is set), then `schedule` down towards `min_lr`, which the
    step after the last would take (vitkit.train.optim.lr_at).
    `weight_decay` is decoupled (AdamW; the paper's Flax Adam is the same) and applies only to weights of 2 or
    more dimensions, never to biases, norms, the position embedding or the class token.
    `clip_grad_norm`: clip the global gradient norm to this value (0: off).
    `loss`: 'softmax' cross-entropy, or 'sigmoid': a binary cross-entropy per class, summed over the classes
    (the paper's ImageNet-21k pre-training; see vitkit.train.losses). `label_smoothing` applies to either.
    `head_bias`: the value the new classifier's bias starts at (the paper's pre-training: -10 with the sigmoid
    loss; 0 otherwise, as the zero-initialised fine-tuning head).
    `layer_decay`: layer-wise learning-rate decay for fine-tuning (BEiT, MAE): block i's parameters take
    lr * layer_decay^(depth - i), the embeddings (patches, class token, positions) lr * layer_decay^(depth +
    1), the final LayerNorm and the head the full lr; 1: off.
    `freeze`: parameters kept fixed, by name pattern (fnmatch: `patch_embed.*`, `blocks.[0-5].*`): no
    gradients, no optimizer state; a pattern that names no parameter of the model is refused.
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
    layer_decay: float = 1.0
    freeze: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        object.__setattr__(self, "freeze", tuple(self.freeze))
        errors = range_errors(self, OPTIM_RANGES)
        if errors:  # the checks below compare these
            raise ValueError("invalid optim settings: " + "; ".join(errors))
        errors = choice_errors(self, {"name": typing.get_args(Optimizer),
                                      "schedule": typing.get_args(Schedule), "loss": typing.get_args(Loss)})
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
    "eps": Range(0, open_low=True), "momentum": Range(0, 1, open_high=True),
    "warmup_steps": Range(0, integer=True),
    "warmup_epochs": Range(0), "min_lr": Range(0), "clip_grad_norm": Range(0),
    "label_smoothing": Range(0, 1, open_high=True), "layer_decay": Range(0, 1, open_low=True),
}


@dataclass(frozen=True)
class DataConfig:
    """What to train and evaluate on.

    `name`: a dataset name (fashion-mnist, cifar10, cifar100), a folder of class sub-folders, a Hugging Face
    dataset folder (`hf:FOLDER`) or tar shards (`shards:PATTERN`, see `vitkit shard`; training only, with
    val_split ''); see `vitkit.data.resolve`.
    `val_split`: what the run evaluates as it trains, which chooses `best/`: 'auto' is the data's own val
    split where it has one (a folder's val/), else `holdout` images held out of the training split
    ('holdout': a fixed part, each class in its share, the same for every seed; the run trains on the rest);
    or a split by name ('val', 'test'), or '' for none. `test_split`: evaluated once, with the final weights,
    at the end ('auto': the data's test split where it has one, else none; '' for none): the figure the run
    reports, never used to choose anything.
    `limit`/`val_limit`: use only N images (0: all), for quick runs, spread evenly over the split so that a
    folder's classes all keep their share (vitkit.data.subsets). `workers`: DataLoader processes, used for
    datasets that are not held in memory (image folders, shards); in-memory datasets are augmented whole
    batches at a time.
    """

    name: str = "fashion-mnist"
    data_dir: str | None = None
    train_split: str = "train"
    val_split: str = "auto"
    test_split: str = "auto"
    holdout: int = 5000
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


DATA_RANGES = {"limit": Range(0, integer=True), "val_limit": Range(0, integer=True),
               "holdout": Range(0, integer=True),
               "workers": Range(0, integer=True), "eval_batch_size": Range(1, integer=True)}


@dataclass(frozen=True)
class TrainConfig:
    """A whole training run. `batch_size` is the global batch (all processes, all accumulation steps);
    `micro_batch` is what one process puts through the model at once (0: batch_size / processes, i.e. no
    gradient accumulation). Length: `steps` if set, else `epochs` (fractions allowed).

    `init`: a checkpoint or model name to fine-tune from (the head is replaced for the data's classes and the
    position embedding resampled to `model.image_size`, Sec. 3.2); empty: train `model` from scratch.
    `posemb_interpolation`: how that resampling interpolates (vitkit.posemb.resample_pos_embed): 'bicubic'
    with antialiasing as timm, 'bilinear', or 'bilinear-corners' as the paper's code (scipy.ndimage.zoom,
    order 1). `full_token_epochs`: with PatchDropout (`model.patch_dropout`), the last this-many epochs train
    on every patch token, so that training ends on the token count the model is evaluated with (FLIP's
    "unmasked tuning", Li et al. 2023); 0: PatchDropout to the end. Without PatchDropout it changes nothing.
    `ema`: decay of an exponential moving average of the weights (0: off); when on, evaluation and the saved
    models use the averaged weights. `precision`: 'auto' is bf16 autocast on CUDA and fp32 on a CPU;
    'bf16-native' also takes bf16 on CPUs that compute it in hardware (AVX512-BF16, AMX), fp32 on others.
    `eval_every`, `ckpt_every`: in steps (0: at the end of every epoch). `keep_last`: training-state
    checkpoints kept (the best and the last models are kept apart, as vitkit checkpoints).
    `compile`: train through `torch.compile` (inductor; evaluation stays eager). The first steps wait for the
    compilation (20-90 s on 2 CPU cores, again when PatchDropout turns off); on in the `fashion-mnist` recipe,
    whose small model it fuses (with vitkit's attention operator in the graph, docs/training.md), off
    elsewhere, so that short runs never wait for a compiler. Without a C++ compiler on the CPU it warns and
    trains eagerly.
    `fast`: train with vitkit's CPU kernels swapped in (`vitkit.accelerate`: the same function and gradients,
    faster); nothing is swapped on a GPU. `--no-fast` (or `--set fast=false`) trains the plain model.
    `max_skipped_steps`: a step whose gradient norm is nan or infinite is skipped (the weights, optimizer and
    EMA untouched; counted as `skipped_steps` in metrics.csv); after this many in a row the run stops, naming
    the step and the last checkpoint.
    `grad_checkpointing`: recompute each block's activations in the backward pass instead of keeping them
    (VisionTransformer.set_grad_checkpointing): the same gradients, much less activation memory, about a
    third more time per step.
    `parallel`: how several processes share the training. 'ddp': each holds the whole model, optimizer and
    EMA, and the gradients are averaged. 'fsdp': FSDP2 shards them over the processes, per block and at the
    root (vitkit.train.sharding), and the checkpoints are sharded too (vitkit.train.dcp_checkpoints).
    `teacher`: a trained classifier of the same classes (a run's `best`, or anything vitkit.load reads) whose
    top class for each augmented image teaches the model, DeiT's hard distillation (vitkit.train.distill):
    the loss is (1 - distill_weight) x the loss on the labels + distill_weight x the cross-entropy of the
    distillation head (`model.distilled`; the class head without one) against the teacher's class.
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
    max_skipped_steps: int = 5
    compile: bool = False
    fast: bool = True
    grad_checkpointing: bool = False
    parallel: Parallel = "ddp"
    teacher: str = ""
    distill_weight: float = 0.5

    def __post_init__(self) -> None:
        errors = range_errors(self, TRAIN_RANGES) + nonfinite_errors(self.augment, "augment.")
        errors += choice_errors(self, {"precision": typing.get_args(Precision),
                                       "parallel": typing.get_args(Parallel),
                                       "posemb_interpolation": POSEMB_MODES})
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


# `ema` is a decay (0 is off); `seed` feeds numpy's seed, which takes 32 bits; the `*_every` 0 means "every
# epoch".
TRAIN_RANGES = {
    "epochs": Range(0), "steps": Range(0, integer=True), "full_token_epochs": Range(0),
    "batch_size": Range(1, integer=True), "micro_batch": Range(0, integer=True),
    "ema": Range(0, 1, open_high=True),
    "seed": Range(0, 2**32, integer=True, open_high=True), "threads": Range(0, integer=True),
    "eval_every": Range(0, integer=True), "ckpt_every": Range(0, integer=True),
    "keep_last": Range(1, integer=True), "log_every": Range(1, integer=True),
    "max_skipped_steps": Range(1, integer=True), "distill_weight": Range(0, 1),
}


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
