"""What a training run is made of before its first step: the process's settings and seed, the device it asks
for, the training and validation data, and the model (from scratch or from a checkpoint to fine-tune)."""

from __future__ import annotations

import dataclasses
import json
import random
import warnings

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import Dataset

from ..config import ViTConfig
from ..data import resolve
from ..data.datasets import split_name
from ..data.subsets import spread_subset
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


def evaluated_split(cfg: TrainConfig, train_set: Dataset | None = None,
                    val_set: Dataset | None = None) -> str:
    """The name of the split a run evaluates on (`cfg.data.val_split`, or 'val' for datasets given to train):
    the one read, e.g. 'test' for Fashion-MNIST's val, which is its test split."""
    if train_set is None and val_set is None and cfg.data.val_split:
        return split_name(cfg.data.name, cfg.data.val_split)
    return "val"


def load_data(cfg: TrainConfig, train_set: Dataset | None = None, val_set: Dataset | None = None):
    """The training and validation datasets (None when there is no validation) and the class names.

    The validation labels index the training classes, matched by name: an image folder numbers its classes by
    position among its own sub-folders, so a val/ lacking one of train/'s classes would shift every label
    after it. A validation class the training data lacks is refused, named (see with_classes)."""
    d = cfg.data
    split = evaluated_split(cfg, train_set, val_set)
    if train_set is None:
        if not d.name:
            raise ValueError("no training data: set data.name to a dataset name or a folder "
                             "(e.g. --set data.name=/data/imagenet)")
        train_set = resolve(d.name, d.train_split, d.data_dir, d.download, d.skip_bad_images)
        if val_set is None and d.val_split:
            val_set = resolve(d.name, d.val_split, d.data_dir, d.download, d.skip_bad_images)
            if getattr(val_set, "split_of_root", False):  # a folder without split folders: its own images
                warnings.warn(f"{d.name} has no {d.train_split}/ and {d.val_split}/ sub-folders: the "
                              f"{d.val_split} split is the training images themselves, so its accuracy (and "
                              "the choice of best/) says how well they are fitted, not how the model "
                              f"generalises; give the folder {d.train_split}/ and {d.val_split}/ "
                              "sub-folders, or set data.val_split='' to train without evaluation",
                              stacklevel=2)
    classes = list(getattr(train_set, "classes", None) or [])
    if not classes:
        raise ValueError("the training set has no `.classes`; give it a list of class names")
    if val_set is not None:
        val_set = with_classes(val_set, classes, f"the {split} split", "the training split")
        val_set = spread_subset(val_set, d.val_limit)
    return spread_subset(train_set, d.limit), val_set, classes


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
