"""The training loop, in the style of nanoGPT's train.py and DeiT's engine.py: explicit steps, no callbacks.

    vitkit train demo --out runs/demo                                   # one process
    torchrun --nproc_per_node 2 -m vitkit.cli.main train demo --out D   # DDP, the same code

One optimizer step: the schedule sets the learning rate; this process's micro-batches (see batches.py) go
forward and backward, the loss of each divided by their number so the gradients add up to the mean over the
process's share (DDP then averages over the processes: the mean over the global batch); the gradient norm is
clipped; the optimizer steps; the EMA of the weights follows. Evaluation and checkpoints come every
`eval_every` / `ckpt_every` steps (default: every epoch) and at the end, and after the step in flight when
Ctrl-C or SIGTERM asks the run to stop (stopping.py).

`train` sets a run up (prepare.py: data, model; run_folder.py: the folder, the resume checks), then
`train_steps` runs the loop, whose steps are functions below: `train_one_step`, `evaluate_and_keep_best`,
`checkpoint_or_stop`. `Run` holds what they share.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from ..checkpoint import CheckpointError
from ..cpu import accelerate
from ..cpu.allocator import return_large_blocks
from ..model import VisionTransformer
from . import distributed, sharding
from .batches import (
    Batch,
    BatchPlan,
    LoaderBatches,
    MemoryBatches,
    ShardBatches,
    batch_source,
    make_plan,
    steps_per_epoch,
)
from .checkpoints import latest_checkpoint, restore_rng, save_model_atomically, save_train_state
from .dcp_checkpoints import load_sharded_train_state, save_sharded_train_state
from .distill import Teacher, hard_distillation_loss, load_teacher
from .ema import EMA
from .evaluate import EvalResult, evaluate
from .losses import classification_loss
from .metrics_log import MetricsLog
from .one_step import (
    autocast_dtype,
    compiled,
    forward_backward,
    gradient_norm,
    optimizer_step,
    quiet_same_layout_stride_warnings,
)
from .optim import build_optimizer, freeze, lr_at, set_lr
from .prepare import (
    RunData,
    build_process_model,
    device_unavailable,
    load_data,
    set_up_process,
    skipped_images,
)
from .recipes import missing_init
from .report import Report, progress_bar
from .run_folder import (
    FINAL_OUTPUTS,
    check_run_folder,
    damaged_checkpoint,
    diverged_message,
    missing_final_outputs,
    open_run_folder,
    read_resume_checkpoint,
    write_final_outputs,
)
from .settings import TrainConfig
from .stopping import StopRequests, TrainingStopped


class TrainingDiverged(ValueError):
    """The gradient norm was nan or infinite for `max_skipped_steps` steps in a row; the message says at which
    step and which checkpoint is the last good."""


@dataclass
class RunResult:
    """What a run ended with. `final`: the last evaluation as it trained, on the split named `split` (its
    held-out part, or a val split), whose best top-1 `best_top1` chose best/; `test`: the final weights on the
    split named `test_split`, evaluated once at the end. Each None without such a split, or when a resumed
    run was already complete with all of its outputs."""

    run_dir: Path
    steps: int
    seconds: float
    final: EvalResult | None
    best_top1: float | None
    last_dir: Path
    best_dir: Path | None
    split: str = "val"
    test: EvalResult | None = None
    test_split: str = ""


@dataclass(frozen=True)
class Lengths:
    """A run's lengths, in optimizer steps."""

    per_epoch: int
    total: int
    warmup: int
    full_tokens_from: int  # PatchDropout is off from this step on
    eval_every: int
    ckpt_every: int

    @classmethod
    def of(cls, cfg: TrainConfig, num_images: int) -> Lengths:
        per_epoch = steps_per_epoch(num_images, cfg.batch_size)
        total = cfg.steps or max(1, round(cfg.epochs * per_epoch))
        return cls(per_epoch, total,
                   warmup=cfg.optim.warmup_steps or round(cfg.optim.warmup_epochs * per_epoch),
                   full_tokens_from=total - round(cfg.full_token_epochs * per_epoch),
                   eval_every=cfg.eval_every or per_epoch, ckpt_every=cfg.ckpt_every or per_epoch)


@dataclass
class Run:
    """One run's parts and where it stands, shared by the steps below: the resolved config, the run folder and
    the processes, the data and its batches, the model with its optimizer and EMA, and the step, the best
    top-1 and the training time so far."""

    cfg: TrainConfig
    out: Path
    ctx: distributed.Context
    split: str  # the name of the split evaluated as it trains ('holdout': a part of the training split)
    train_set: Dataset
    val_set: Dataset | None
    classes: list[str]
    test_split: str  # the name of the split evaluated once at the end ('' for none)
    test_set: Dataset | None
    model: VisionTransformer
    optimizer: torch.optim.Optimizer
    ema: EMA | None
    source: MemoryBatches | LoaderBatches | ShardBatches
    plan: BatchPlan
    lengths: Lengths
    amp: torch.dtype | None  # the autocast dtype (None: fp32)
    t_start: float
    step: int = 0
    best: float | None = None
    elapsed_before: float = 0.0  # the seconds trained before the run was resumed
    skipped: int = 0  # steps skipped for a non-finite gradient norm, in all
    skipped_in_a_row: int = 0  # ... and in a row, up to this step

    @property
    def fsdp(self) -> bool:
        return self.cfg.parallel == "fsdp"

    @property
    def ddp(self) -> bool:
        """Whether the model trains under DistributedDataParallel: several processes, not sharded."""
        return self.ctx.distributed and not self.fsdp

    @property
    def eval_model(self) -> nn.Module:
        """The weights evaluated and saved: the EMA's when the run keeps one. Under FSDP, a plain copy
        gathered whole on every process (sharding.gathered_copy), so every process must ask for it,
        together."""
        return sharding.gathered_copy(self.ema.module if self.ema is not None else self.model, self.cfg.fast)

    def seconds(self) -> float:
        return self.elapsed_before + time.time() - self.t_start


# --- the run -----------------------------------------------------------------------------------------------
def train(cfg: TrainConfig, out: str | Path, resume: bool = False, train_set: Dataset | None = None,
          val_set: Dataset | None = None, progress: bool | None = True) -> RunResult:
    """Run `cfg`, writing the run folder `out` (see checkpoints.py for its layout). With `resume`, continue
    from the newest complete checkpoint in `out`. `train_set`/`val_set` replace the datasets `cfg.data`
    names (any Dataset with `.classes` whose items are (image, label)). `progress`: a progress bar on stderr
    (None: only where stderr is a terminal)."""
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


def _train(cfg: TrainConfig, out: Path, resume: bool, train_set: Dataset | None, val_set: Dataset | None,
           progress: bool | None, ctx: distributed.Context, held: contextlib.ExitStack) -> RunResult:
    t_start = time.time()
    if cfg.parallel == "fsdp" and ctx.distributed and ctx.device.type == "cpu":
        return_large_blocks()  # FSDP's per-block buffers would fragment the heap (vitkit.cpu.allocator)
    set_up_process(cfg)
    data = load_data(cfg, train_set, val_set)
    model, model_cfg = build_process_model(cfg, len(data.classes), ctx.rank, ctx.world)
    cfg = dataclasses.replace(cfg, model=model_cfg)  # the resolved config: what actually runs
    newest = open_run_folder(cfg, out, resume, ctx, held)
    run = build_run(cfg, out, ctx, data, model, t_start)
    del model  # under FSDP the main process's whole model: the run holds its shards only
    if resume and newest is not None:
        resume_state(run, newest)
    if run.step >= run.lengths.total:
        return finish_complete_run(run)
    return train_steps(run, progress)


def build_run(cfg: TrainConfig, out: Path, ctx: distributed.Context, data: RunData,
              model: VisionTransformer | None, t_start: float) -> Run:
    """The run at step 0: its batches and lengths, the model on its device with a new optimizer and EMA. With
    `parallel=fsdp` on several processes, `model` is the main process's (None on the others) and the run
    holds its shards instead, the EMA sharded alike (sharding.py), so that it costs each process its share
    only, updated shard by shard with no communication."""
    plan = make_plan(cfg.batch_size, cfg.micro_batch, ctx.world, ctx.rank)
    source = batch_source(data.train, cfg.model, cfg.augment, len(data.classes), cfg.seed, cfg.data.workers)
    if cfg.parallel == "fsdp" and ctx.distributed:
        mesh, policy = sharding.device_mesh(ctx.device, ctx.world), sharding.mixed_precision(ctx.device)
        model = sharding.shard_from_main(model, cfg.model, mesh, ctx.device, policy)
        ema_module = sharding.sharded_copy(model, mesh, ctx.device, policy) if cfg.ema else None
    else:
        model.to(ctx.device)
        ema_module = None
    model.set_grad_checkpointing(cfg.grad_checkpointing)
    if cfg.fast:
        accelerate(model)  # vitkit's CPU kernels, in place (nothing is swapped on a GPU)
        if ema_module is not None:
            accelerate(ema_module)
    freeze(model, cfg.optim.freeze)  # before the optimizer: the frozen ones get no state
    ema = EMA(model, cfg.ema, ema_module) if cfg.ema else None
    optimizer = build_optimizer(model, cfg.optim)
    return Run(cfg, out, ctx, data.val_split, data.train, data.val, data.classes, data.test_split, data.test,
               model, optimizer, ema, source, plan, Lengths.of(cfg, len(source)),
               autocast_dtype(cfg.precision, ctx.device), t_start)


def resume_state(run: Run, newest: Path) -> None:
    """Load the checkpoint `newest` into `run`: the weights, the optimizer, the EMA, the random states, the
    step, the best top-1 and the time trained. A sharded checkpoint (`parallel=fsdp`) may have been written by
    another number of processes (dcp_checkpoints.py says what carries over)."""
    world, notes = run.ctx.world, []
    if run.fsdp:
        try:
            state, notes = load_sharded_train_state(newest, run.model, run.optimizer, run.ema, run.ctx.rank,
                                                    world)
        except CheckpointError as e:
            raise damaged_checkpoint(run.out, newest, e) from None
    else:
        ck = read_resume_checkpoint(run.out, newest, with_ema=run.ema is not None)
        run.model.load_state_dict(ck["model"])
        run.optimizer.load_state_dict(ck["optimizer"])
        if run.ema is not None:
            run.ema.load_state_dict(ck["ema"], ck["state"]["ema_updates"])
        restore_rng(*ck["rng"])
        state = ck["state"]
    run.step, run.best = state["step"], state["best_top1"]
    run.elapsed_before = state.get("seconds", 0.0)
    run.skipped, run.skipped_in_a_row = state.get("skipped_steps", 0), state.get("skipped_in_a_row", 0)
    before = state.get("processes", world)
    if before != world and isinstance(run.source, ShardBatches):
        notes.append(f"note: {newest.name} was trained by {before} process(es), and the run goes on with "
                     f"{world}: shards are split per process, so the rest of this epoch comes from the new "
                     "split (some of its samples may come twice, others not at all); the epochs after it are "
                     "whole")
    elif before != world and (run.cfg.model.dropout or run.cfg.model.attn_dropout):
        notes.append(f"note: {newest.name} was trained by {before} process(es), and the run goes on with "
                     f"{world}: the batches and every per-image draw are the same, but dropout draws per "
                     "micro-batch, so the run goes on differently from an unbroken one")
    if run.ctx.is_main:
        print(f"resuming {run.out} from {newest.name} (epoch {run.step / run.lengths.per_epoch:.2f})",
              flush=True)
        for note in notes:
            print(note, flush=True)


def finish_complete_run(run: Run) -> RunResult:
    """A resumed run that has trained all of its steps: write only the end-of-run outputs it lacks (it was
    stopped between its last checkpoint and them), evaluating its final weights again when they need it."""
    missing = missing_final_outputs(run.out, run.val_set is not None or run.test_set is not None)
    if run.ctx.is_main:
        print(f"{run.out} is already complete ({run.step} of {run.lengths.total} steps)"
              + (f"; writing its missing {', '.join(missing)}" if missing else ""), flush=True)
    result = None
    if missing and run.val_set is not None:  # as the run's own end would: its final weights on the val split
        result = evaluate(run.eval_model, run.val_set, run.cfg.model, run.cfg.data.eval_batch_size,
                          run.ctx.device, run.amp, run.ctx.rank, run.ctx.world)
    test = write_end_of_run(run, result, missing, run.elapsed_before) if missing else None
    distributed.barrier()
    return run_result(run, run.elapsed_before, result, test)


def train_steps(run: Run, progress: bool | None) -> RunResult:
    """Train from `run.step` to the last step, evaluating and checkpointing on the way, then write the
    end-of-run outputs. Ctrl-C or SIGTERM stops the run after the step in flight, with a checkpoint."""
    cfg, ctx, lengths = run.cfg, run.ctx, run.lengths
    net = distributed.data_parallel(run.model) if run.ddp else run.model
    if cfg.compile:
        # the same parameters: the optimizer, EMA and checkpoints use `model` as before
        net = compiled(net, ctx.device)
    loss_fn = classification_loss(cfg.optim.loss, cfg.optim.label_smoothing)
    val_loss = classification_loss(cfg.optim.loss)  # the same loss on the true labels, without smoothing
    teacher = None
    if cfg.teacher:  # DeiT's hard distillation: the teacher's classes are the loss's third argument
        teacher = load_teacher(cfg.teacher, cfg.model, len(run.classes), ctx.device, cfg.compile)
        loss_fn = hard_distillation_loss(loss_fn, cfg.distill_weight)
        run.model.set_distilled_training(cfg.model.distilled)
    report = Report(MetricsLog(run.out, ctx.is_main, run.step), progress_bar(run, progress),
                    lines=progress is not False and ctx.is_main)
    result = None
    epoch = run.step // lengths.per_epoch
    with StopRequests(announce=ctx.is_main) as stops, contextlib.ExitStack() as closing:
        closing.callback(report.close)
        if run.ddp:
            closing.enter_context(quiet_same_layout_stride_warnings(run.model))
        while run.step < lengths.total:
            first = run.step % lengths.per_epoch
            last = min(lengths.per_epoch, first + lengths.total - run.step)
            for _, micro_batches in run.source.epoch(epoch, run.plan, first, last):
                lr, loss, stop = train_one_step(run, net, micro_batches, loss_fn, stops, teacher)
                report.after_step(run, lr, loss)
                if run.step % lengths.eval_every == 0 or run.step == lengths.total:
                    result = evaluate_and_keep_best(run, report, val_loss)
                checkpoint_or_stop(run, stop, stops)
            epoch += 1
            skipped = skipped_images(run.train_set)
            if skipped and ctx.is_main:
                report.print(f"skipped {len(skipped)} unreadable image(s) so far, e.g. {skipped[0]}")
    seconds = run.seconds()
    test = write_end_of_run(run, result, list(FINAL_OUTPUTS), seconds)
    distributed.barrier()  # every process returns with the run folder complete: its `last` may be read next
    return run_result(run, seconds, result, test)


# --- the steps of the loop ---------------------------------------------------------------------------------
def train_one_step(run: Run, net: nn.Module, micro_batches: list[Batch], loss_fn, stops: StopRequests,
                   teacher: Teacher | None = None) -> tuple[float, float | None, bool]:
    """One optimizer step at `run.step` (see the module's docstring), which it then advances. Returns the
    learning rate, the loss (the mean over the processes; None except at a log step, the only steps that read
    it back from the device) and whether a process was asked to stop.

    A step whose gradient norm is not finite is skipped: the weights, the optimizer and the EMA stay as they
    were (the schedule and the data move on), `run.skipped` counts it, and after `max_skipped_steps` of them
    in a row the run stops (TrainingDiverged) naming the step and the last checkpoint."""
    cfg, ctx, lengths = run.cfg, run.ctx, run.lengths
    lr = lr_at(run.step, lengths.total, cfg.optim.lr, lengths.warmup, cfg.optim.schedule, cfg.optim.min_lr)
    set_lr(run.optimizer, lr)
    run.model.patch_drop_rate = 0.0 if run.step >= lengths.full_tokens_from else cfg.model.patch_dropout
    # Under FSDP each micro-batch's gradients are reduce-scattered into the shards as its backward ends.
    loss = forward_backward(net, micro_batches, loss_fn, ctx.device, run.amp, run.ddp, teacher)
    norm = gradient_norm(run.model, cfg.optim.clip_grad_norm)  # the same on every process (averaged grads)
    # Whether the gradients are finite and whether a signal asked this process to stop, summed over the
    # processes, which must all skip or stop together, at the same step; at a log step the loss rides along,
    # so that the one logged is the mean over the processes, not the main process's share.
    logged = (run.step + 1) % cfg.log_every == 0 or run.step + 1 == lengths.total
    flags = [torch.isfinite(norm).float(), norm.new_tensor(float(stops.requested))]
    flags = torch.stack(flags + ([loss.float().to(norm.device)] if logged else []))
    if ctx.distributed:
        flags = distributed.all_reduce_sum(flags)
    finite, stop, *loss_sum = flags.tolist()
    if finite == ctx.world:
        optimizer_step(run.model, run.optimizer)
        if run.ema is not None:
            run.ema.update(run.model)
        run.skipped_in_a_row = 0
    else:
        run.optimizer.zero_grad(set_to_none=True)
        run.skipped += 1
        run.skipped_in_a_row += 1
        if run.skipped_in_a_row >= cfg.max_skipped_steps:
            raise TrainingDiverged(diverged_message(run.step, run.skipped_in_a_row, lengths.per_epoch,
                                                    run.out))
    run.step += 1
    return lr, (loss_sum[0] / ctx.world if loss_sum else None), stop > 0


def evaluate_and_keep_best(run: Run, report: Report, loss_fn) -> EvalResult | None:
    """Evaluate the run's weights (the EMA's when it keeps one) on the validation split and log the result;
    weights whose top-1 is the best so far are saved as RUN/best. None when the run has no validation
    split."""
    if run.val_set is None:
        return None
    cfg, ctx = run.cfg, run.ctx
    model = run.eval_model
    r = evaluate(model, run.val_set, cfg.model, cfg.data.eval_batch_size, ctx.device, run.amp,
                 ctx.rank, ctx.world, loss_fn=loss_fn)
    report.log.write(run.step, run.step / run.lengths.per_epoch, "val", loss=r.loss, top1=r.top1,
                     top5=r.reported_top5)
    improved = run.best is None or r.top1 > run.best
    if ctx.is_main:
        report.print(f"step {run.step}/{run.lengths.total} {run.split} {r.summary()} loss {r.loss:.4f}"
                     + (f" ({r.skipped} unreadable image(s) skipped)" if r.skipped else ""))
        if improved:
            save_model_atomically(model, run.out / "best", run.classes,
                                  {"train": {"step": run.step, **r.to_dict()}})
    if improved:
        run.best = r.top1
    return r


def checkpoint_or_stop(run: Run, stop: bool, stops: StopRequests) -> None:
    """Save the training state every `ckpt_every` steps, at the last step, and when a process was asked to
    stop; then, so asked, stop the run (TrainingStopped) unless it ends at this step anyway."""
    stopping = stop and run.step < run.lengths.total
    if run.step % run.lengths.ckpt_every == 0 or run.step == run.lengths.total or stopping:
        if run.fsdp:
            save_sharded_train_state(run.out, run.step, run.model, run.optimizer, run.ema, train_state(run),
                                     run.ctx.rank, run.ctx.world, run.cfg.keep_last)
        elif run.ctx.is_main:
            save_train_state(run.out, run.step, run.model, run.optimizer, train_state(run), run.classes,
                             run.ema.state_dict() if run.ema else None, run.cfg.keep_last)
        distributed.barrier()
    if stopping:
        raise TrainingStopped(stops.signum or signal.SIGTERM, run.step, run.lengths.total,
                              latest_checkpoint(run.out) or run.out / "ckpt")


def train_state(run: Run) -> dict[str, Any]:
    """What a checkpoint records of the run besides its tensors."""
    per_epoch = run.lengths.per_epoch
    return {"epoch": run.step // per_epoch, "step_in_epoch": run.step % per_epoch,
            "total_steps": run.lengths.total,
            "best_top1": run.best, "ema_updates": run.ema.updates if run.ema else 0, "seconds": run.seconds(),
            "processes": run.ctx.world, "skipped_steps": run.skipped,
            "skipped_in_a_row": run.skipped_in_a_row}


def write_end_of_run(run: Run, result: EvalResult | None, names: list[str],
                     seconds: float) -> EvalResult | None:
    """The end-of-run outputs among `names` (FINAL_OUTPUTS), written by the main process, after the final
    weights' one evaluation on the test split (when the run has one and result.json is to be written; every
    process evaluates its share). Returns that evaluation."""
    test = None
    testing = run.test_set is not None and "result.json" in names
    # the final weights once (under FSDP gathering them is a collective and a whole copy per process)
    model = run.eval_model if testing or "last" in names else None
    if testing:
        test = evaluate(model, run.test_set, run.cfg.model, run.cfg.data.eval_batch_size,
                        run.ctx.device, run.amp, run.ctx.rank, run.ctx.world,
                        loss_fn=classification_loss(run.cfg.optim.loss))
        if run.ctx.is_main:
            print(f"{run.test_split} {test.summary()} on {test.count} images (final weights)", flush=True)
    # Each process skipped the bad files of its own share of the data: the list is all of theirs.
    local = [str(p) for data in (run.train_set, run.val_set, run.test_set) for p in skipped_images(data)]
    skipped = list(dict.fromkeys(distributed.gather_strings(local)))
    if run.ctx.is_main:
        write_final_outputs(run.out, names, model, run.classes, result, recipe=run.cfg.recipe,
                            step=run.step, seconds=seconds, processes=run.ctx.world, best_top1=run.best,
                            skipped=skipped, val_split=run.split, test=test, test_split=run.test_split)
    return test


def run_result(run: Run, seconds: float, final: EvalResult | None,
               test: EvalResult | None = None) -> RunResult:
    best_dir = run.out / "best" if (run.out / "best").is_dir() else None
    return RunResult(run.out, run.step, seconds, final, run.best, run.out / "last", best_dir, run.split, test,
                     run.test_split)
