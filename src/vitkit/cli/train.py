"""`vitkit train` (a recipe into a run folder), `vitkit eval` (metrics on a dataset) and `vitkit predict`
(top-k labels for image files and folders)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..train.recipes import RECIPES
from .device import DEVICE_HELP, parse_device

_RECIPE_HELP = "Recipe: " + ", ".join(RECIPES) + "."


def inference_model(model, fast: bool):
    """The model to run for eval/predict: with `fast`, `vitkit.optimize(model)` (same function, a faster
    path) in a process whose allocator keeps freed memory (vitkit.cpu.allocator); otherwise the model
    itself."""
    if not fast:
        return model
    from ..cpu.allocator import retain_freed_memory
    from ..inference import optimize

    retain_freed_memory()
    return optimize(model, precision="fp32")


def launch_torchrun(nproc: int, train_args: list[str]) -> int:
    """Run `vitkit train TRAIN_ARGS` as `nproc` processes under torchrun on this machine and return its exit
    code. Each process gets (cores / nproc) threads unless OMP_NUM_THREADS is set."""
    import signal
    import subprocess
    import sys

    from ..cpu.hardware import usable_cores
    from ..train.distributed import end_with_parent
    from ..train.stopping import STOP_SIGNALS

    env = dict(os.environ)
    cores = usable_cores()
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    cmd = [sys.executable, "-c", QUIET_TORCHRUN, "--standalone", f"--nproc_per_node={nproc}",
           "-m", "vitkit.cli.main", "train", *train_args]
    # torchrun ends with this process, whatever ends it, and takes its workers along (they end with it, and
    # stop as a SIGTERM asks: after a checkpoint). It runs in a session of its own, out of reach of the
    # terminal's Ctrl-C, so that each signal reaches it once, from here: torchrun hands it to the workers,
    # which stop after the step in flight with a checkpoint, and this process waits for them.
    proc = subprocess.Popen(cmd, env=env, preexec_fn=end_with_parent, start_new_session=True)
    previous = {sig: signal.signal(sig, lambda signum, frame: proc.send_signal(signum))
                for sig in STOP_SIGNALS}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code  # killed by a signal: the shell's code for it


def resume_command(recipe: str, out: Path, nproc: int) -> str:
    """The command that continues a stopped run: a bare --resume, which goes on with the run's config.json."""
    import shlex

    return shlex.join(["vitkit", "train", recipe, "--out", str(out), "--resume",
                       *(["--nproc", str(nproc)] if nproc > 1 else [])])


def continue_hint(recipe: str, out: Path, env: dict[str, str]) -> str:
    """How to continue a stopped run: its `vitkit train ... --resume` on one machine; on several (torchrun's
    LOCAL_WORLD_SIZE below its WORLD_SIZE), each machine's torchrun command again, with --resume."""
    world = int(env.get("WORLD_SIZE", "1"))
    if int(env.get("LOCAL_WORLD_SIZE", str(world))) < world:
        return "the same torchrun command on every machine, with --resume (docs/distributed.md)"
    return resume_command(recipe, out, world)


# torchrun's own main, without the traceback of its ChildFailedError or SignalException: a worker that fails
# has printed its one-line error already, a stopped run its message, and the exit code says which.
QUIET_TORCHRUN = """\
import logging
import os
import sys
# torchrun's warnings as it hands a signal on to the workers (its loggers take LOGLEVEL, or their parent's)
os.environ.setdefault("LOGLEVEL", "ERROR")
logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main
try:
    main(sys.argv[1:])
except ChildFailedError:
    sys.exit(1)
except SignalException as e:  # it handed the signal to the workers, which stopped after a checkpoint
    sys.exit(128 + int(e.sigval))
"""


def _load(checkpoint: str):
    from .. import load

    return load(checkpoint)


def train(
    recipe: str = typer.Argument(..., help=_RECIPE_HELP),
    out: Path = typer.Option(..., "--out", "-o",
                             help="Run folder: checkpoints, logs, the best and last models."),
    resume: bool = typer.Option(False, "--resume",
                                help="Continue from the newest complete checkpoint in --out, with the run's "
                                     "own config.json (a --set that changes one of its values is refused)."),
    overrides: list[str] = typer.Option(None, "--set", "-s", metavar="KEY=VALUE",
                                        help="Override a setting, e.g. --set optim.lr=0.002 --set "
                                             "model.depth=4 (repeatable; unknown keys are rejected with the "
                                             "valid ones)."),
    show: bool = typer.Option(False, "--show", help="Print the resolved config as JSON and exit."),
    progress: bool | None = typer.Option(None, "--progress/--no-progress", show_default=False,
                                         help="A progress bar on stderr (by default only when stderr is a "
                                              "terminal, so that a log file holds no frames of it)."),
    nproc: int = typer.Option(1, "--nproc", min=1,
                              help="Data-parallel processes on this machine: starts torchrun --standalone "
                                   "with N processes of (cores / N) threads each. On 2 CPU cores, 2 "
                                   "processes of 1 thread train the small recipes faster than 1 process of 2 "
                                   "threads."),
    fast: bool = typer.Option(True, "--fast/--no-fast",
                              help="Train with vitkit's CPU kernels swapped in (vitkit.accelerate: same "
                                   "function, faster); --no-fast trains the plain model (the setting "
                                   "`fast`)."),
) -> None:
    """Train a ViT with a recipe, on one process or data-parallel.

    With --nproc N, or under `torchrun --nproc_per_node N -m vitkit.cli.main train ...`, the same command runs
    data-parallel (gloo on CPUs, nccl on GPUs)."""
    from ..train import get_recipe
    from .main import UsageError

    if recipe not in RECIPES:
        raise UsageError(f"unknown recipe {recipe!r}", f"choose from {', '.join(RECIPES)}")
    if not fast:
        overrides = [*(overrides or []), "fast=false"]
    try:
        # resuming: the run's own config.json, with any --set applied to it; else the recipe's
        if resume:
            from ..train.run_folder import config_to_resume
        cfg = (config_to_resume(out, recipe, overrides or []) if resume else None) \
            or get_recipe(recipe, overrides or [])
    except ValueError as e:
        raise UsageError(str(e), "see `vitkit train --help`; keys are dotted, e.g. optim.lr") from None
    if show:
        typer.echo(cfg.to_json(), nl=False)
        return
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        # This process only starts torchrun and waits for it: it leaves the trainer and torchvision unloaded.
        from ..train.distributed import pick_device
        from ..train.order import make_plan

        try:  # what every process would refuse, refused once before any starts
            pick_device(cfg.device, local_rank=nproc - 1)  # one GPU each
            make_plan(cfg.batch_size, cfg.micro_batch, nproc, 0)  # the batch splits over the processes
        except ValueError as e:
            raise UsageError(str(e), "see `vitkit train --help`") from None
        args = [recipe, "--out", str(out), *(["--resume"] if resume else []),
                *(a for o in overrides or [] for a in ("--set", o)),
                *{None: [], True: ["--progress"], False: ["--no-progress"]}[progress]]
        raise typer.Exit(launch_torchrun(nproc, args))
    from ..train import train as run
    from ..train.stopping import TrainingStopped

    try:
        result = run(cfg, out, resume=resume, progress=progress)
    except TrainingStopped as e:
        if os.environ.get("RANK", "0") == "0":
            typer.echo(f"{e}\ncontinue with: {continue_hint(recipe, out, dict(os.environ))}", err=True)
        raise typer.Exit(e.exit_code) from None
    if os.environ.get("RANK", "0") != "0":  # under torchrun, the main process reports
        return
    took = f"{result.seconds / 60:.1f} min" if result.seconds >= 60 else f"{result.seconds:.0f} s"
    # the headline: the final weights on the test split where the run has one, else on its validation split
    final, split = ((result.test, result.test_split) if result.test is not None
                    else (result.final, result.split))
    if final is not None:
        skipped = f" ({final.skipped} unreadable skipped)" if final.skipped else ""
        typer.echo(f"{split} {final.summary()} on {final.count} images{skipped}; {result.steps} steps "
                   f"in {took}")
    models = [f"{kind} model: {path}" for kind, path in (("last", result.last_dir), ("best", result.best_dir))
              if path is not None and path.is_dir()]
    typer.echo("   ".join(models) or f"no model in {result.run_dir}")


def eval(
    checkpoint: str = typer.Argument(..., help="A checkpoint folder or file (anything `vitkit.load` reads)."),
    data: str = typer.Option(..., "--data", "-d",
                             help="Dataset name (fashion-mnist, cifar10, cifar100) or a folder."),
    split: str = typer.Option("auto", "--split",
                              help="Split: test, val or train; auto is the data's test split, else its val "
                                   "split, else a folder's own images."),
    data_dir: Path = typer.Option(None, "--data-dir",
                                  help="Where to look for (and download) named datasets."),
    batch_size: int = typer.Option(256, "--batch-size", "-b", min=1, help="Images per forward pass."),
    limit: int = typer.Option(0, "--limit", min=0,
                              help="Evaluate only N images, spread evenly over the split so "
                                   "that every class keeps its share (0: all)."),
    out: Path = typer.Option(None, "--out", "-o",
                             help="Folder for metrics.json and confusion.png (default: eval-CHECKPOINT-DATA "
                                  "beside the checkpoint, or here for a hub name)."),
    skip_bad_images: bool = typer.Option(False, "--skip-bad-images",
                                         help="Skip unreadable images in a folder."),
    fast: bool = typer.Option(True, "--fast/--no-fast",
                              help="Run through vitkit.optimize (same results, faster)."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    workers: int = typer.Option(0, "--workers", "-j", min=0,
                                help="Processes that read and decode an image folder's files (0: this one)."),
    progress: bool | None = typer.Option(None, "--progress/--no-progress", show_default=False,
                                         help="A progress bar on stderr (by default only when stderr is a "
                                              "terminal, so that a log file holds no frames of it)."),
) -> None:
    """Top-1, top-5, loss and per-class accuracy on a dataset, and a confusion-matrix PNG."""
    from ..data import resolve
    from ..data.datasets import evaluation_split
    from ..data.subsets import spread_subset
    from ..train.evaluate import confusion_png, evaluate
    from ..train.prepare import skipped_images
    from .main import UsageError

    model = _load(checkpoint)
    cfg = model.cfg
    split = evaluation_split(data, split)
    dataset = resolve(data, split, data_dir, skip_bad_images=skip_bad_images)
    try:
        dataset, note = match_classes(dataset, getattr(model, "class_names", None), cfg.num_classes, data,
                                      checkpoint)
    except ValueError as e:
        raise UsageError(str(e), "evaluate on the dataset the model was trained for") from None
    if note:
        typer.echo(f"note: {note}", err=True)
    dataset = spread_subset(dataset, limit)
    dev = parse_device(device)
    net = inference_model(model.to(dev), fast)
    result = evaluate(net, dataset, cfg, batch_size, dev, workers=workers, progress=progress)
    folder = out or _default_eval_dir(checkpoint, data, split)
    folder.mkdir(parents=True, exist_ok=True)
    # As a run's result.json: the metrics and every unreadable file skipped.
    metrics = {**result.to_dict(), "skipped_images": [str(p) for p in skipped_images(dataset)]}
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    png = confusion_png(result, folder / "confusion.png", f"{Path(checkpoint).name} on {data} ({split}): "
                                                          f"top-1 {100 * result.top1:.2f} %")
    table = Table()
    table.add_column("class")
    table.add_column("accuracy", justify="right")
    for name, acc in result.to_dict()["per_class"].items():
        table.add_row(name, "no images" if acc is None else f"{100 * acc:.2f} %")
    console = Console(width=100)
    skipped = f", {result.skipped} unreadable skipped" if result.skipped else ""
    console.print(f"{checkpoint} on {data} ({split}, {result.count} images{skipped})")
    console.print(table)
    console.print(f"{result.summary()}, loss {result.loss:.4f}")
    if png is not None:
        console.print(f"confusion matrix: {png}")
    console.print(f"metrics: {folder / 'metrics.json'}")


def match_classes(dataset, class_names: list[str] | None, num_classes: int, data: str, checkpoint: str):
    """The dataset with labels numbered as the checkpoint's classes, and a note for the user (or None).

    With the checkpoint's class names, the data's classes are matched by name (a folder numbers its classes by
    position among its own sub-folders, which differs as soon as one is missing); a data class the checkpoint
    lacks raises ValueError naming it. Names that share nothing with the checkpoint's, in the same number, are
    taken by position with a note: other names for the same classes, as an ImageNet folder's WordNet ids
    (n01440764, ...) for the names a converted checkpoint carries (tench, ...). Without names, the counts must
    agree."""
    from ..data.views import with_classes

    classes = list(getattr(dataset, "classes", None) or [])
    if class_names and classes and not set(classes).isdisjoint(class_names):
        return with_classes(dataset, class_names, str(data), str(checkpoint)), None
    if len(classes) != num_classes:
        raise ValueError(f"{data} has {len(classes)} classes but {checkpoint} predicts {num_classes}")
    if class_names and classes != list(class_names):
        return dataset, (f"none of {data}'s {len(classes)} class names is one of {checkpoint}'s; "
                         "taking them in sorted order as its classes")
    return dataset, None


def _default_eval_dir(checkpoint: str, data: str, split: str = "test") -> Path:
    """eval-CHECKPOINT-DATA beside the checkpoint (never inside a checkpoint folder, which a run replaces
    whole and an upload sends as it is; in the current folder for a hub name), with -SPLIT for a split other
    than test, so that evaluating another split or checkpoint overwrites nothing."""
    p = Path(checkpoint)
    if p.exists():
        place, name = p.parent, p.stem if p.is_file() else p.name
    else:  # a hub name: its last part
        place, name = Path("."), checkpoint.rstrip("/").split("/")[-1].split(":")[-1]
    suffix = "" if split == "test" else f"-{split}"
    return place / f"eval-{name or 'model'}-{Path(data).name or 'data'}{suffix}"


def predict(
    checkpoint: str = typer.Argument(..., help="A checkpoint folder or file (anything `vitkit.load` reads)."),
    paths: list[Path] = typer.Argument(..., help="Image files and folders (searched recursively)."),
    top_k: int = typer.Option(5, "--top-k", "-k", min=1, help="Labels per image."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per image instead of text; an image "
                                 "that cannot be read is an object with its `error` (on stderr)."),
    fast: bool = typer.Option(True, "--fast/--no-fast",
                              help="Run through vitkit.optimize (same results, faster)."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    progress: bool | None = typer.Option(None, "--progress/--no-progress", show_default=False,
                                         help="A progress bar on stderr (by default only when stderr is a "
                                              "terminal; the results' lines are never mixed with it)."),
) -> None:
    """Top-k labels with probabilities for image files and folders.

    Unreadable files are reported one line each (the others are still classified) and make the exit code 1."""
    import sys

    from tqdm.auto import tqdm

    from ..train.predict import Prediction, classify_expanded, expand_paths

    model = _load(checkpoint)
    dev = parse_device(device)
    net = inference_model(model.to(dev), fast)
    found = failed = 0
    expanded = expand_paths(paths)  # walked once: for the bar's total, and then classified
    files = set(expanded[0])
    # tqdm's disable=None: a bar only where stderr is a terminal. Each result is written as it comes (a large
    # folder shows its first labels after one batch), through tqdm.write, which lifts the bar first.
    with tqdm(total=len(files), desc="predict", unit="img", leave=False,
              disable=None if progress is None else not progress) as bar:
        names = getattr(model, "class_names", None)
        for r in classify_expanded(net, expanded, model.cfg, top_k, names, device=dev):
            if isinstance(r, Prediction):
                found += 1
                bar.update(1)
                if as_json:
                    line = json.dumps({"path": str(r.path), "labels": r.labels, "probs": r.probs})
                else:
                    line = f"{r.path}: " + ", ".join(f"{label} {100 * prob:.1f} %"
                                                     for label, prob in zip(r.labels, r.probs, strict=True))
                bar.write(line, file=sys.stdout)
            else:
                failed += 1
                bar.update(r.path in files)  # a path that does not exist is no image of the total
                line = (json.dumps({"path": str(r.path), "error": r.message}) if as_json
                        else f"error: {r.message}")
                bar.write(line, file=sys.stderr)
    if failed:
        raise typer.Exit(1)
    if not found:
        from .main import UsageError

        raise UsageError("no images found in " + " ".join(map(str, paths)),
                         "give image files or folders of them")


def register(app: typer.Typer) -> None:
    app.command()(train)
    app.command(name="eval")(eval)
    app.command()(predict)
