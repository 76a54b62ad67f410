"""The training loop, in the style of nanoGPT's train.py and DeiT's engine.py: explicit steps, no callbacks.

    vitkit train demo --out runs/demo                                   # one process
    torchrun --nproc_per_node 2 -m vitkit.cli.main train demo --out D   # DDP, the same code

One optimizer step: the schedule sets the learning rate; this process's micro-batches (see batches.py) go
forward and backward, the loss of each divided by their number so the gradients add up to the mean over the
process's share (DDP then averages over the processes: the mean over the global batch); the gradient norm is
clipped; the optimizer steps; the EMA of the weights follows. Evaluation and checkpoints come every
`eval_every` / `ckpt_every` steps (default: every epoch) and at the end, and after the step in flight when
Ctrl-C or SIGTERM asks the run to stop (stopping.py).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import math
import os
import random
import signal
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from ..checkpoint import CheckpointError
from ..data import resolve
from ..data.datasets import split_name
from ..data.subsets import spread_subset
from ..data.views import with_classes
from ..files import atomic_write
from ..hardware import cpu_has_native_bf16
from ..model import VisionTransformer
from . import distributed
from .batches import batch_source, is_in_memory, make_plan, steps_per_epoch
from .checkpoints import (
    RunFolderLock,
    clean_leftovers,
    latest_checkpoint,
    list_checkpoints,
    load_train_state,
    restore_rng,
    save_model_atomically,
    save_train_state,
    step_of,
)
from .ema import EMA
from .evaluate import EvalResult, confusion_png, evaluate
from .losses import classification_loss
from .optim import build_optimizer, lr_at, set_lr
from .recipes import missing_init
from .settings import TrainConfig
from .stopping import StopRequests, TrainingStopped

# Settings that may change when a run is resumed: they do not alter what is computed.
RESUMABLE_CHANGES = ("log_every", "eval_every", "ckpt_every", "keep_last", "device", "threads", "data.workers",
                     "data.eval_batch_size", "data.data_dir", "data.download", "compile",
                     # what a diverged run needs to go on from its last good checkpoint (_diverged_message)
                     "optim.lr", "optim.clip_grad_norm")


class TrainingDiverged(ValueError):
    """The loss became nan or infinite; the message says at which step and which checkpoint is the last good."""


@dataclass
class RunResult:
    """What a run ended with. `final`: the last evaluation, on the split named `split` (None without one, or
    when a resumed run was already complete with all of its outputs)."""

    run_dir: Path
    steps: int
    seconds: float
    final: EvalResult | None
    best_top1: float | None
    last_dir: Path
    best_dir: Path | None
    split: str = "val"


# --- data and model ---------------------------------------------------------------------------------------
def evaluated_split(cfg: TrainConfig, train_set: Dataset | None = None, val_set: Dataset | None = None) -> str:
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
                warnings.warn(f"{d.name} has no {d.train_split}/ and {d.val_split}/ sub-folders: the {d.val_split} "
                              "split is the training images themselves, so its accuracy (and the choice of best/) "
                              "says how well they are fitted, not how the model generalises; give the folder "
                              f"{d.train_split}/ and {d.val_split}/ sub-folders, or set data.val_split='' to train "
                              "without evaluation", stacklevel=2)
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


def check_run_folder(out: Path, resume: bool) -> None:
    """Refuse, before any data is loaded, a run folder that cannot be used: a path that is a file or lies under
    one, or a folder holding another run when not resuming."""
    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                where = "" if path == out else f" ({path} is a file)"
                raise ValueError(f"--out {out}: not a folder{where}; choose another --out")
            if not os.access(path, os.W_OK | os.X_OK):
                raise ValueError(f"--out {out}: {path} is not writable (a read-only filesystem, or no "
                                 "permission); choose another --out")
            break
    newest = latest_checkpoint(out)
    if newest is not None and not resume:
        raise ValueError(f"{out} already holds a run (checkpoint {newest.name}); pass --resume to continue it, "
                         "or choose another --out")


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


FINAL_OUTPUTS = ("last", "result.json", "confusion.png")  # written at the end of a run, after its last checkpoint


def missing_final_outputs(out: Path, evaluated: bool) -> list[str]:
    """The end-of-run outputs a run folder lacks (confusion.png only counts when the run evaluates). A run
    killed after its final checkpoint but before writing these has finished training: resuming it writes just
    these."""
    return [name for name in FINAL_OUTPUTS if not (out / name).exists() and (evaluated or name != "confusion.png")]


def build_model(cfg: TrainConfig, num_classes: int) -> VisionTransformer:
    """From scratch (`cfg.model` with the data's number of classes), or from `cfg.init` for fine-tuning:
    the checkpoint's weights with every setting of `cfg.model` that differs from the checkpoint's own (the
    recipe's training rates, `--set model.*`; prepare_finetune refuses those that would change a weight's shape),
    its position table resampled as `cfg.posemb_interpolation` says. Either way the new classifier's bias
    starts at `cfg.optim.head_bias`."""
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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of a `precision` on `device` (None: fp32). 'auto': bf16 on CUDA, fp32 on a CPU;
    'bf16': bf16 everywhere (emulated, and slower, on CPUs without native bf16); 'bf16-native': bf16 on CUDA
    and on CPUs that compute bf16 in hardware (AVX512-BF16, AMX), fp32 on other CPUs; 'fp32': never."""
    if precision == "bf16" or (precision in ("auto", "bf16-native") and device.type == "cuda"):
        return torch.bfloat16
    if precision == "bf16-native" and device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return None


def saved_config(path: Path) -> dict[str, Any]:
    """A run's config.json as a dict, with the settings it predates at their defaults (the behaviour it was
    started with), so that a run started by an older vitkit resumes; as written where it no longer parses."""
    saved = json.loads(path.read_text())
    try:
        return json.loads(TrainConfig.from_dict(saved).to_json())
    except (ValueError, TypeError, KeyError):
        return saved


def check_same_run(saved_cfg: Path, cfg: TrainConfig) -> None:
    """Refuse to resume a run with another config than the one it was started with (its RUN/config.json),
    but for the settings a resumed run may change (RESUMABLE_CHANGES). Without that file nothing can be
    checked, and that too is refused: a run folder whose config.json is gone is not the run it was."""
    if not saved_cfg.is_file():
        raise ValueError(f"--resume: {saved_cfg} is missing, so this config cannot be checked against the one the "
                         f"run was started with; put it back (a copy of the run's config), or start a new run in "
                         "another --out")
    try:
        saved = saved_config(saved_cfg)
    except (OSError, ValueError) as e:  # a truncated or hand-damaged file
        raise ValueError(f"--resume: {saved_cfg} is unreadable ({e}); put back the run's config, or start a new "
                         "run in another --out") from None
    changed = [k for k in config_differences(saved, json.loads(cfg.to_json())) if k not in RESUMABLE_CHANGES]
    if changed:
        raise ValueError(f"--resume: the config differs from the one {saved_cfg.parent} was started with, in "
                         f"{', '.join(changed)}; resume with the same recipe and --set options")


def read_resume_checkpoint(out: Path, newest: Path, with_ema: bool) -> dict[str, Any]:
    """The newest checkpoint's training state, or an error that says which folder to delete to resume from the
    one before it (a checkpoint is written whole and renamed into place, so an unreadable one was damaged
    afterwards: a disk fault, a partial copy)."""
    try:
        ck = load_train_state(newest)
        if with_ema and ck["ema"] is None:
            raise CheckpointError(f"{newest}: no ema.safetensors, though this run keeps an EMA of its weights")
    except CheckpointError as e:
        older = [p for p in list_checkpoints(out) if p != newest]
        fix = (f"delete {newest} to resume from {older[-1].name}, the checkpoint before it" if older else
               "it is the run's only checkpoint: start again in a new --out")
        raise ValueError(f"--resume: {e}; {fix}") from None
    return ck


def config_differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested config dicts."""
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += config_differences(va, vb, prefix + key + ".")
        elif va != vb:
            out.append(prefix + key)
    return out


# --- logging -----------------------------------------------------------------------------------------------
class MetricsLog:
    """Metrics to RUN/metrics.csv and TensorBoard (RUN/tb); only the main process writes."""

    COLUMNS = ("time", "step", "epoch", "split", "loss", "lr", "img_per_s", "top1", "top5")

    def __init__(self, run_dir: Path, enabled: bool, resume_step: int):
        self.enabled = enabled
        self.path = run_dir / "metrics.csv"
        self.tb = None
        if not enabled:
            return
        if resume_step and self.path.is_file():
            # Rows a killed run wrote after its last checkpoint are replayed by the resumed run: drop them.
            self._rewrite([r for r in self.read_rows(self.path) if int(r["step"]) <= resume_step])
        elif not self.path.is_file() or not resume_step:
            self._rewrite([])
        from torch.utils.tensorboard import SummaryWriter

        # Events after the checkpoint a run resumes from are replayed: purge them (the checkpoint's own step stays).
        self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=resume_step + 1 if resume_step else None)

    @classmethod
    def read_rows(cls, path: Path) -> list[dict[str, str]]:
        """The complete rows of a metrics.csv: a row a kill cut short (the file's last line, without its newline)
        or one that is not a row of these columns is left out."""
        text = path.read_text(errors="replace")
        if not text.endswith("\n"):
            text = text[:text.rfind("\n") + 1]
        rows = []
        for r in csv.DictReader(text.splitlines(), restkey="_extra"):
            if "_extra" in r or any(r.get(c) is None for c in cls.COLUMNS):
                continue
            try:
                int(r["step"])
            except ValueError:
                continue
            rows.append(r)
        return rows

    def _rewrite(self, rows: list[dict]) -> None:
        def write(tmp: str) -> None:
            with open(tmp, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=self.COLUMNS)
                w.writeheader()
                w.writerows(rows)

        atomic_write(self.path, write)

    def write(self, step: int, epoch: float, split: str, **values: float | None) -> None:
        """One row; a None value (top-5 of 5 classes or fewer) leaves its cell empty and draws no point."""
        if not self.enabled:
            return
        values = {k: v for k, v in values.items() if v is not None}
        row = {"time": f"{time.time():.1f}", "step": step, "epoch": f"{epoch:.4f}", "split": split}
        row.update({k: f"{v:.6g}" for k, v in values.items()})
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.COLUMNS).writerow(row)
        for k, v in values.items():
            self.tb.add_scalar(f"{split}/{k}", v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


# --- one optimizer step -------------------------------------------------------------------------------------
def forward_backward(net: nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                     loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device,
                     amp: torch.dtype | None, ddp: bool = False) -> torch.Tensor:
    """Forward and backward over one step's micro-batches; each loss is divided by their number so that the
    gradients add up to the mean over all of them. Under DDP the gradients are averaged over the processes on
    the last micro-batch only. Returns the mean loss (a 0-d tensor, not synchronised)."""
    total = torch.zeros((), device=device)
    for j, (x, y) in enumerate(micro_batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        sync = not ddp or j == len(micro_batches) - 1
        with contextlib.nullcontext() if sync else net.no_sync():
            with torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext():
                logits = net(x)
            # Soft labels (MixUp/CutMix) and integer labels alike; the loss in fp32 even under autocast.
            loss = loss_fn(logits, y)
            (loss / len(micro_batches)).backward()
        total += loss.detach()
    return total / len(micro_batches)


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, clip_grad_norm: float = 0.0) -> None:
    """Clip the global gradient norm (when asked), step, and clear the gradients."""
    if clip_grad_norm:
        nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# --- the loop ----------------------------------------------------------------------------------------------
def train(cfg: TrainConfig, out: str | Path, resume: bool = False, train_set: Dataset | None = None,
          val_set: Dataset | None = None, progress: bool = True) -> RunResult:
    """Run `cfg`, writing the run folder `out` (see checkpoints.py for its layout). With `resume`, continue
    from the newest complete checkpoint in `out`. `train_set`/`val_set` replace the datasets `cfg.data`
    names (any Dataset with `.classes` whose items are (image, label))."""
    out = Path(out)
    problem = missing_init(cfg) or device_unavailable(cfg.device)
    if problem:
        raise ValueError(problem)
    check_run_folder(out, resume)
    owned = not torch.distributed.is_initialized()  # leave a caller's own process group alone
    # The run sets the process's thread count and determinism (`threads`, `deterministic`): a notebook gets
    # its own back when the run ends.
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    ctx = distributed.setup(cfg.device)
    try:
        with contextlib.ExitStack() as held:  # the run folder's lock, while the run writes it
            return _train(cfg, out, resume, train_set, val_set, progress, ctx, held)
    finally:
        if owned:
            distributed.teardown()
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


def _train(cfg: TrainConfig, out: Path, resume: bool, train_set, val_set, progress: bool,
           ctx: distributed.Context, held: contextlib.ExitStack) -> RunResult:
    t_start = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    seed_everything(cfg.seed)  # the same on every process: the same initial weights
    device = ctx.device

    split = evaluated_split(cfg, train_set, val_set)
    train_set, val_set, classes = load_data(cfg, train_set, val_set)
    model = build_model(cfg, len(classes))
    cfg = dataclasses.replace(cfg, model=model.cfg)  # the resolved config: what actually runs

    # The run folder: one run at a time, which tidies what a killed one left; a new run must not overwrite an
    # old one (checked again under the lock: train() checked before the data was loaded); a resumed one must be
    # the same run.
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        held.enter_context(RunFolderLock(out))
        clean_leftovers(out)
    check_run_folder(out, resume)
    newest = latest_checkpoint(out)
    saved_cfg = out / "config.json"
    if resume and newest is not None:
        check_same_run(saved_cfg, cfg)
    if ctx.is_main:
        atomic_write(saved_cfg, lambda tmp: Path(tmp).write_text(cfg.to_json()))
    distributed.barrier()
    # Every process must see the same folder (and so resume from the same step): on several machines, one
    # their filesystems share. Without it each would start from what its own disk holds.
    newest_step = step_of(newest) if newest is not None else -1
    seen = newest_step if saved_cfg.is_file() else -2
    if not distributed.agree(seen, device):
        raise ValueError(f"the processes of this run see different contents in {out}: --out must be a folder on "
                         "a filesystem that every machine of the run shares")

    plan = make_plan(cfg.batch_size, cfg.micro_batch, ctx.world, ctx.rank)
    source = batch_source(train_set, cfg.model, cfg.augment, len(classes), cfg.seed, cfg.data.workers)
    per_epoch = steps_per_epoch(len(source), cfg.batch_size)
    total = cfg.steps or max(1, round(cfg.epochs * per_epoch))
    warmup = cfg.optim.warmup_steps or round(cfg.optim.warmup_epochs * per_epoch)
    full_tokens_from = total - round(cfg.full_token_epochs * per_epoch)  # PatchDropout off from this step
    eval_every = cfg.eval_every or per_epoch
    ckpt_every = cfg.ckpt_every or per_epoch

    model.to(device)
    optimizer = build_optimizer(model, cfg.optim)
    ema = EMA(model, cfg.ema) if cfg.ema else None
    step, best, elapsed_before = 0, None, 0.0
    if resume and newest is not None:
        ck = read_resume_checkpoint(out, newest, with_ema=ema is not None)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        if ema is not None:
            ema.load_state_dict(ck["ema"], ck["state"]["ema_updates"])
        restore_rng(*ck["rng"])
        step, best = ck["state"]["step"], ck["state"]["best_top1"]
        elapsed_before = ck["state"].get("seconds", 0.0)
        if ctx.is_main:
            print(f"resuming {out} from {newest.name} (epoch {step / per_epoch:.2f})", flush=True)
            before = ck["state"].get("processes", ctx.world)
            if before != ctx.world and is_in_memory(train_set):
                print(f"note: {newest.name} was trained by {before} process(es), and the run goes on with "
                      f"{ctx.world}: the batches are the same, but in-memory augmentation is drawn per process "
                      "and micro-batch, so the run goes on differently from an unbroken one", flush=True)
    eval_model = ema.module if ema is not None else model
    amp = autocast_dtype(cfg.precision, device)
    loss_fn = classification_loss(cfg.optim.loss, cfg.optim.label_smoothing)
    val_loss = classification_loss(cfg.optim.loss)  # the same loss on the true labels, without smoothing

    def final_outputs(step_now: int, seconds: float, result: EvalResult | None, names: list[str]) -> None:
        # Each process skipped the bad files of its own share of the data: the list is all of theirs.
        local = [str(p) for p in skipped_images(train_set) + skipped_images(val_set)]
        skipped = list(dict.fromkeys(distributed.gather_strings(local)))
        if ctx.is_main:
            write_final_outputs(out, names, eval_model, classes, result, recipe=cfg.recipe, step=step_now,
                                seconds=seconds, processes=ctx.world, best_top1=best, skipped=skipped)

    if step >= total:  # resuming a finished run: only the end-of-run outputs it may lack are left to write
        missing = missing_final_outputs(out, val_set is not None)
        if ctx.is_main:
            print(f"{out} is already complete ({step} of {total} steps)"
                  + (f"; writing its missing {', '.join(missing)}" if missing else ""), flush=True)
        result = None
        if missing and val_set is not None:  # as the run's own end would: its final weights on the val split
            result = evaluate(eval_model, val_set, cfg.model, cfg.data.eval_batch_size, device, amp, ctx.rank,
                              ctx.world)
        if missing:
            final_outputs(step, elapsed_before, result, missing)
        distributed.barrier()
        best_dir = out / "best" if (out / "best").is_dir() else None
        return RunResult(out, step, elapsed_before, result, best, out / "last", best_dir, split)
    net = DistributedDataParallel(model) if ctx.distributed else model
    if cfg.compile:
        net = torch.compile(net)  # the same parameters: the optimizer, EMA and checkpoints use `model` as before
    log = MetricsLog(out, ctx.is_main, step)
    bar = None
    if progress and ctx.is_main:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=step, desc=cfg.recipe or "train", unit="step", dynamic_ncols=True,
                   mininterval=1.0)

    def state(step_now: int) -> dict[str, Any]:
        return {"epoch": step_now // per_epoch, "step_in_epoch": step_now % per_epoch, "total_steps": total,
                "best_top1": best, "ema_updates": ema.updates if ema else 0,
                "seconds": elapsed_before + time.time() - t_start, "processes": ctx.world}

    def run_eval(step_now: int) -> EvalResult | None:
        nonlocal best
        if val_set is None:
            return None
        r = evaluate(eval_model, val_set, cfg.model, cfg.data.eval_batch_size, device, amp, ctx.rank, ctx.world,
                     loss_fn=val_loss)
        log.write(step_now, step_now / per_epoch, "val", loss=r.loss, top1=r.top1, top5=r.reported_top5)
        if ctx.is_main:
            msg = (f"step {step_now}/{total} {split} {r.summary()} "
                   f"loss {r.loss:.4f}" + (f" ({r.skipped} unreadable image(s) skipped)" if r.skipped else ""))
            (bar.write if bar else print)(msg)
            if best is None or r.top1 > best:
                save_model_atomically(eval_model, out / "best", classes, {"train": {"step": step_now, **r.to_dict()}})
        if best is None or r.top1 > best:
            best = r.top1
        return r

    window_t, window_n, loss_ema = time.time(), 0, None
    result = None
    epoch = step // per_epoch
    with StopRequests(announce=ctx.is_main) as stops, contextlib.ExitStack() as closing:
        closing.callback(log.close)
        if bar is not None:
            closing.callback(bar.close)
        while step < total:
            first = step % per_epoch
            last = min(per_epoch, first + total - step)
            for _, micro_batches in source.epoch(epoch, plan, first, last):
                lr = lr_at(step, total, cfg.optim.lr, warmup, cfg.optim.schedule, cfg.optim.min_lr)
                set_lr(optimizer, lr)
                model.patch_drop_rate = 0.0 if step >= full_tokens_from else cfg.model.patch_dropout
                loss = forward_backward(net, micro_batches, loss_fn, device, amp, ctx.distributed)
                # Whether the loss is finite here, and whether a signal asked this process to stop: under DDP
                # summed over the processes, which must all stop together, at the same step. The loss rides
                # along, so that the one logged is the mean over the processes, not the main process's share.
                flags = torch.stack([torch.isfinite(loss).float(), loss.new_tensor(float(stops.requested)),
                                     torch.nan_to_num(loss.float())])
                if ctx.distributed:
                    flags = distributed.all_reduce_sum(flags)
                finite, stop, loss_sum = flags.tolist()
                if finite < ctx.world:
                    raise TrainingDiverged(_diverged_message(float(loss), step, per_epoch, out))
                optimizer_step(model, optimizer, cfg.optim.clip_grad_norm)
                if ema is not None:
                    ema.update(model)
                step += 1

                window_n += cfg.batch_size
                lv = loss_sum / ctx.world
                loss_ema = lv if loss_ema is None else 0.9 * loss_ema + 0.1 * lv
                if bar is not None:
                    bar.update(1)
                if step % cfg.log_every == 0 or step == total:
                    ips = window_n / max(time.time() - window_t, 1e-9)
                    window_t, window_n = time.time(), 0
                    log.write(step, step / per_epoch, "train", loss=lv, lr=lr, img_per_s=ips)
                    if bar is not None:
                        bar.set_postfix(loss=f"{loss_ema:.4f}", lr=f"{lr:.2e}", img_s=f"{ips:.0f}",
                                        epoch=f"{step / per_epoch:.2f}")
                if step % eval_every == 0 or step == total:
                    result = run_eval(step)
                stopping = stop > 0 and step < total  # at the last step the run ends anyway
                if step % ckpt_every == 0 or step == total or stopping:
                    if ctx.is_main:
                        save_train_state(out, step, model, optimizer, state(step), classes,
                                         ema.state_dict() if ema else None, cfg.keep_last)
                    distributed.barrier()
                if stopping:
                    raise TrainingStopped(stops.signum or signal.SIGTERM, step, total,
                                          latest_checkpoint(out) or out / "ckpt")
            epoch += 1
            skipped = skipped_images(train_set)
            if skipped and ctx.is_main:
                (bar.write if bar else print)(f"skipped {len(skipped)} unreadable image(s) so far, e.g. {skipped[0]}")

    seconds = elapsed_before + time.time() - t_start
    final_outputs(step, seconds, result, list(FINAL_OUTPUTS))
    best_dir = out / "best" if (out / "best").is_dir() else None
    return RunResult(out, step, seconds, result, best, out / "last", best_dir, split)


def write_final_outputs(out: Path, names: list[str], model: nn.Module, classes: list[str],
                        result: EvalResult | None, *, recipe: str, step: int, seconds: float, processes: int,
                        best_top1: float | None, skipped: list[str]) -> None:
    """Write the end-of-run outputs among `names` (see FINAL_OUTPUTS): the last model (`last/`, a plain
    vitkit checkpoint with the final metrics), the confusion matrix of the final evaluation, and result.json
    (the final metrics with the confusion matrix left out, and every unreadable image file skipped)."""
    if "last" in names:
        extra = {"train": {"step": step, "seconds": seconds, **(result.to_dict() if result else {})}}
        save_model_atomically(model, out / "last", classes, extra)
    if "confusion.png" in names and result is not None:
        confusion_png(result, out / "confusion.png", f"{recipe}: top-1 {100 * result.top1:.2f} % "
                                                     f"on {result.count} images")
    if "result.json" in names:
        summary = {"recipe": recipe, "steps": step, "seconds": round(seconds, 1), "processes": processes,
                   "best_top1": best_top1, **(result.to_dict() if result else {})}
        summary.pop("confusion", None)
        summary["skipped_images"] = skipped
        (out / "result.json").write_text(json.dumps(summary, indent=2) + "\n")


def _diverged_message(loss: float, step: int, per_epoch: int, out: Path) -> str:
    good = latest_checkpoint(out)
    kind = "nan" if math.isnan(loss) else "infinite"
    said = f"the loss became {kind} at step {step + 1} (epoch {step / per_epoch:.2f}); training stopped and "
    if good is None:
        return said + ("no checkpoint was written yet. Start again with a lower optim.lr or with "
                       "optim.clip_grad_norm set (the same --out will do: it holds no checkpoint)")
    return said + (f"the last good checkpoint is {good}. Lower optim.lr or set optim.clip_grad_norm, and "
                   "--resume with them (if that checkpoint's weights have grown too large already, start again in "
                   "a new --out)")
