"""What a training run is made of before its first step: the process's settings and seed, the device it asks
for, the training and validation data, and the model (from scratch or from a checkpoint to fine-tune)."""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import Dataset

from ..config import ViTConfig
from ..data import resolve
from ..data.datasets import own_splits
from ..data.subsets import holdout_split, spread_subset
from ..data.views import with_classes
from ..model import VisionTransformer
from .settings import TrainConfig


def set_up_process(cfg: TrainConfig) -> None:
    """The process's thread count and determinism as `cfg` asks (train() restores the caller's when the run
    ends), and the same seed on every process: the same initial weights."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    seed_everything(cfg.seed)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def device_unavailable(name: str) -> str | None:
    """Why this machine cannot run on device `name` (None when it can): a GPU index past its GPUs, or no MPS.
    TrainConfig checks that the name is one at all; this is the machine's part, checked before any folder is
    written (torch itself would fail only when the model moves there)."""
    if name.startswith("cuda:"):
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(name.split(":")[1]) >= gpus:
            return f"device={name!r} but this machine has {gpus} GPU(s); use device=auto, cuda or cpu"
    if name == "mps" and not torch.backends.mps.is_available():
        return "device='mps' but MPS is not available on this machine; use device=auto or cpu"
    return None


@dataclass
class RunData:
    """What a run trains and evaluates on: the training set, the set it evaluates as it trains (`val`, which
    chooses best/; None without one) and the one it evaluates once at the end (`test`; None without one),
    the names of those two splits ('holdout' for a part held out of the training split) and the classes."""

    train: Dataset
    val: Dataset | None
    test: Dataset | None
    classes: list[str]
    val_split: str = ""
    test_split: str = ""


def plan_splits(val_split: str, test_split: str, holdout: int, own: tuple[str, ...]) -> tuple[str, str]:
    """The splits a run evaluates on, named ('' for none), given the data's own splits `own` (of train, val
    and test): 'auto' validation is the data's val split, else `holdout` images of its training split
    ('holdout'); 'auto' test is its test split. A split the data lacks is refused, naming those it has."""
    val = val_split
    if val == "auto":
        val = "val" if "val" in own else ("holdout" if holdout else "")
    test = test_split
    if test == "auto":
        test = "test" if "test" in own and val != "test" else ""
    for key, name in (("val_split", val), ("test_split", test)):
        if name and name != "holdout" and name not in own:
            have = ", ".join(own)
            raise ValueError(f"data.{key}={name!r}, but the data has no {name} split (its splits: {have}); "
                             f"leave data.{key}=auto" + (", which holds a part of the training split out"
                                                         if key == "val_split" else ""))
    if test == "holdout":
        raise ValueError("data.test_split='holdout': the held-out part is for validation (data.val_split)")
    return val, test


def load_data(cfg: TrainConfig, train_set: Dataset | None = None, val_set: Dataset | None = None) -> RunData:
    """The training, validation and test sets and the class names, as `cfg.data` asks (plan_splits); with
    datasets given (`train_set`, and `val_set` or none), those alone: no part held out, no test.

    The held-out part is drawn before `data.limit` applies to the rest. The validation and test labels index
    the training classes, matched by name: an image folder numbers its classes by position among its own
    sub-folders, so a val/ lacking one of train/'s classes would shift every label after it. A class the
    training data lacks is refused, named (see with_classes)."""
    d = cfg.data
    test_set = None
    if train_set is not None:
        val_name, test_name = ("val" if val_set is not None else ""), ""
    else:
        if not d.name:
            raise ValueError("no training data: set data.name to a dataset name or a folder "
                             "(e.g. --set data.name=/data/imagenet)")
        val_name, test_name = plan_splits(d.val_split, d.test_split, d.holdout, own_splits(d.name))

        def read(split: str) -> Dataset:
            return resolve(d.name, split, d.data_dir, d.download, d.skip_bad_images)

        train_set = read(d.train_split)
        if val_name == "holdout":
            train_set, val_set = holdout_split(train_set, d.holdout)
        elif val_name:
            val_set = read(val_name)
        test_set = read(test_name) if test_name else None
    classes = list(getattr(train_set, "classes", None) or [])
    if not classes:
        raise ValueError("the training set has no `.classes`; give it a list of class names")
    if val_set is not None:
        what = "the held-out part" if val_name == "holdout" else f"the {val_name} split"
        val_set = spread_subset(with_classes(val_set, classes, what, "the training split"), d.val_limit)
    if test_set is not None:
        test_set = with_classes(test_set, classes, f"the {test_name} split", "the training split")
    return RunData(spread_subset(train_set, d.limit), val_set, test_set, classes, val_name, test_name)


def skipped_images(dataset: Dataset) -> list:
    """The unreadable files an image folder skipped so far (`skip_bad_images`), through any wrapping."""
    while dataset is not None and not hasattr(dataset, "skipped"):
        dataset = getattr(dataset, "dataset", None)
    return list(dataset.skipped) if dataset is not None else []


def build_process_model(cfg: TrainConfig, num_classes: int, rank: int,
                        world: int) -> tuple[VisionTransformer | None, ViTConfig]:
    """This process's model as `build_model` makes it, and its resolved config. Under `parallel=fsdp` on
    several processes only the main one builds it (None elsewhere) and hands its config to the others, which
    build their shards on the meta device (sharding.shard_from_main): no other process holds the model whole.
    A collective then."""
    if cfg.parallel != "fsdp" or world == 1:
        model = build_model(cfg, num_classes)
        return model, model.cfg
    from .distributed import broadcast_string

    model = build_model(cfg, num_classes) if rank == 0 else None
    text = broadcast_string(json.dumps(model.cfg.to_dict()) if model is not None else "")
    return model, ViTConfig.from_dict(json.loads(text))


def build_model(cfg: TrainConfig, num_classes: int) -> VisionTransformer:
    """From scratch (`cfg.model` with the data's number of classes), or from `cfg.init` for fine-tuning:
    the checkpoint's weights with every setting of `cfg.model` that differs from the checkpoint's own (the
    recipe's training rates, `--set model.*`; prepare_finetune refuses those that would change a weight's
    shape), its position table resampled as `cfg.posemb_interpolation` says. Either way the new classifier's
    bias starts at `cfg.optim.head_bias`."""
    if cfg.init:
        from .. import load
        from ..transfer import prepare_finetune

        source, m = load(cfg.init), cfg.model
        own = ("num_classes", "representation_size", "image_size")  # prepare_finetune's arguments and choices
        changed = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)
                   if f.name not in own and getattr(m, f.name) != getattr(source.cfg, f.name)}
        model = prepare_finetune(source, num_classes, image_size=m.image_size,
                                 interpolation=cfg.posemb_interpolation, **changed)
    else:
        model = VisionTransformer(cfg.model.replace(num_classes=num_classes))
    if cfg.optim.head_bias and isinstance(model.head, nn.Linear):
        with torch.no_grad():
            model.head.bias.fill_(cfg.optim.head_bias)
    return model
