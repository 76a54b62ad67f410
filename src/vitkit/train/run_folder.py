"""The run folder around a training run: the checks before it is written, taking it for a run (its lock and
config.json), what a resumed run must match, and the outputs written at the end (see checkpoints.py for the
layout)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch.nn as nn

from ..checkpoint import CheckpointError
from ..extras import available
from ..files import atomic_write
from . import distributed
from .checkpoints import (
    RunFolderLock,
    clean_leftovers,
    latest_checkpoint,
    list_checkpoints,
    load_train_state,
    save_model_atomically,
    step_of,
)
from .evaluate import EvalResult, confusion_png
from .settings import TrainConfig

# Settings that may change when a run is resumed: they do not alter what is computed.
RESUMABLE_CHANGES = ("log_every", "eval_every", "ckpt_every", "keep_last", "device", "threads",
                     "data.workers",
                     "data.eval_batch_size", "data.data_dir", "data.download", "compile", "fast",
                     "grad_checkpointing",
                     # what a diverged run needs to go on from its last good checkpoint (diverged_message)
                     "optim.lr", "optim.clip_grad_norm")


def check_run_folder(out: Path, resume: bool) -> None:
    """Refuse, before any data is loaded, a run folder that cannot be used: a path that is a file or lies
    under one, or a folder holding another run when not resuming."""
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
        raise ValueError(f"{out} already holds a run (checkpoint {newest.name}); pass --resume to continue "
                         "it, or choose another --out")


def open_run_folder(cfg: TrainConfig, out: Path, resume: bool, ctx: distributed.Context,
                    held: contextlib.ExitStack) -> Path | None:
    """Take `out` for this run and return its newest checkpoint (None when it has none). One run at a time:
    the main process holds the folder's lock (in `held`, for as long as the run) and tidies what a killed run
    left. A new run must not overwrite an old one (checked again under the lock: train() checked before the
    data was loaded); a resumed one must be the same run. Then the run's config.json is written."""
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
    if not distributed.agree(seen, ctx.device):
        raise ValueError(f"the processes of this run see different contents in {out}: --out must be a folder "
                         "on a filesystem that every machine of the run shares")
    return newest


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
        raise ValueError(f"--resume: {saved_cfg} is missing, so this config cannot be checked against the "
                         "one the run was started with; put it back (a copy of the run's config), or start "
                         "a new run in another --out")
    try:
        saved = saved_config(saved_cfg)
    except (OSError, ValueError) as e:  # a truncated or hand-damaged file
        raise ValueError(f"--resume: {saved_cfg} is unreadable ({e}); put back the run's config, or start a "
                         "new run in another --out") from None
    now = json.loads(cfg.to_json())
    changed = [k for k in config_differences(saved, now) if k not in RESUMABLE_CHANGES]
    if changed:
        values = "; ".join(f"{k}={json.dumps(dotted(now, k))} (the run has {json.dumps(dotted(saved, k))})"
                           for k in changed)
        raise ValueError(f"--resume: the config differs from the one {saved_cfg.parent} was started with: "
                         f"{values}; a bare --resume goes on with the run's own config.json")


def dotted(d: dict[str, Any], key: str) -> Any:
    """The value at a dotted key of a nested config dict (None where there is none)."""
    for part in key.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def config_to_resume(out: Path, recipe: str, overrides: list[str]) -> TrainConfig | None:
    """What `vitkit train RECIPE --out OUT --resume [--set ...]` resumes: the run's own config.json, the truth
    of the run, with the `--set` overrides applied (a value the run already has is accepted; one that changes
    it is refused when the run resumes, naming it: check_same_run). None when OUT holds no config.json (a new
    run: the recipe's config). ValueError for another recipe or an unreadable file, naming it."""
    from .overrides import apply_overrides

    path = out / "config.json"
    if not path.is_file():
        return None
    try:
        saved = TrainConfig.from_dict(saved_config(path))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"--resume: {path} is unreadable ({e}); put back the run's config, or start a new "
                         "run in another --out") from None
    if saved.recipe and recipe != saved.recipe:
        raise ValueError(f"--resume: {out} holds a run of the {saved.recipe} recipe, not {recipe}; resume "
                         f"it with `vitkit train {saved.recipe} --out {out} --resume`")
    return apply_overrides(saved, overrides)


def read_resume_checkpoint(out: Path, newest: Path, with_ema: bool) -> dict[str, Any]:
    """The newest checkpoint's training state, or an error that says which folder to delete to resume from the
    one before it (a checkpoint is written whole and renamed into place, so an unreadable one was damaged
    afterwards: a disk fault, a partial copy)."""
    try:
        ck = load_train_state(newest)
        if with_ema and ck["ema"] is None:
            raise CheckpointError(f"{newest}: no ema.safetensors, though this run keeps an EMA of its "
                                  "weights")
    except CheckpointError as e:
        raise damaged_checkpoint(out, newest, e) from None
    return ck


def damaged_checkpoint(out: Path, newest: Path, error: Exception) -> ValueError:
    """The error of a checkpoint that cannot be read, saying which folder to delete to resume from the one
    before it."""
    older = [p for p in list_checkpoints(out) if p != newest]
    fix = (f"delete {newest} to resume from {older[-1].name}, the checkpoint before it" if older else
           "it is the run's only checkpoint: start again in a new --out")
    return ValueError(f"--resume: {error}; {fix}")


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


# written at the end of a run, after its last checkpoint
FINAL_OUTPUTS = ("last", "result.json", "confusion.png")


def missing_final_outputs(out: Path, evaluated: bool) -> list[str]:
    """The end-of-run outputs a run folder lacks (confusion.png only counts when the run evaluates). A run
    killed after its final checkpoint but before writing these has finished training: resuming it writes just
    these."""
    drawn = evaluated and available("matplotlib")  # without it, a resume would only say so again
    return [name for name in FINAL_OUTPUTS
            if not (out / name).exists() and (drawn or name != "confusion.png")]


def write_final_outputs(out: Path, names: list[str], model: nn.Module | None, classes: list[str],
                        result: EvalResult | None, *, recipe: str, step: int, seconds: float, processes: int,
                        best_top1: float | None, skipped: list[str], val_split: str = "val",
                        test: EvalResult | None = None, test_split: str = "") -> None:
    """Write the end-of-run outputs among `names` (see FINAL_OUTPUTS): the last model (`last/`, a plain
    vitkit checkpoint with the final metrics), the confusion matrix of the final evaluation, and result.json.

    result.json holds the final weights' metrics on the validation split (`val`: `result`, with the best
    top-1 that chose best/) and on the test split (`test`), and at its top level the run's headline figure:
    the test split's where the run has one, else the validation split's, named by `split` (the confusion
    matrix left out; every unreadable image file skipped listed)."""
    def metrics(r: EvalResult, split: str, **more) -> dict:
        d = {"split": split, **more, **r.to_dict()}
        d.pop("confusion", None)
        return d

    headline, headline_split = (test, test_split) if test is not None else (result, val_split)
    if "last" in names:
        final = {**(metrics(result, val_split) if result else {}),
                 **({"test": metrics(test, test_split)} if test else {})}
        save_model_atomically(model, out / "last", classes, {"train": {"step": step, "seconds": seconds,
                                                                       **final}})
    if "confusion.png" in names and headline is not None:
        title = f"{recipe}: {headline_split} top-1 {100 * headline.top1:.2f} % on {headline.count} images"
        confusion_png(headline, out / "confusion.png", title)
    if "result.json" in names:
        summary = {"recipe": recipe, "steps": step, "seconds": round(seconds, 1), "processes": processes,
                   **(metrics(headline, headline_split) if headline else {}),
                   "val": metrics(result, val_split, best_top1=best_top1) if result else None,
                   "test": metrics(test, test_split) if test else None,
                   "skipped_images": skipped}
        (out / "result.json").write_text(json.dumps(summary, indent=2) + "\n")


def diverged_message(step: int, in_a_row: int, per_epoch: int, out: Path) -> str:
    """The one line of a run stopped at `step` (0-based) after `in_a_row` steps skipped in a row for a
    non-finite gradient norm: where, and what to do with which checkpoint."""
    good = latest_checkpoint(out)
    first = step + 2 - in_a_row  # 1-based, as the progress bar counts
    steps = f"step {step + 1}" if in_a_row == 1 else f"steps {first} to {step + 1}"
    said = (f"the gradient norm was nan or infinite at {steps} ({in_a_row} in a row, each skipped; epoch "
            f"{(step + 1) / per_epoch:.2f}); training stopped and ")
    if good is None:
        return said + ("no checkpoint was written yet. Start again with a lower optim.lr or with "
                       "optim.clip_grad_norm set (the same --out will do: it holds no checkpoint)")
    return said + (f"the last good checkpoint is {good}. Lower optim.lr or set optim.clip_grad_norm, and "
                   "--resume with them (if that checkpoint's weights have grown too large already, start "
                   "again in a new --out)")
