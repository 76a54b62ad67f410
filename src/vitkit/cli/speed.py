"""`vitkit bench` (inference speed against timm, Hugging Face and torchvision) and `vitkit export` (ONNX,
OpenVINO IR)."""

from __future__ import annotations

from pathlib import Path

import typer

# What a run measures when the command line does not say: the full run, and `--quick`'s look.
FULL_RUN = {"models": ["ViT-S/16", "ViT-B/16"], "batch_sizes": [1, 16], "repeats": 10, "warmup": 2}
QUICK_RUN = {"models": ["ViT-S/16"], "batch_sizes": [1], "repeats": 3, "warmup": 1}


def run_settings(quick: bool, models: list[str], batch_sizes: list[int], repeats: int | None,
                 warmup: int | None) -> dict:
    """The models, batch sizes, repeats and warm-up of a run: those given on the command line, the rest from
    QUICK_RUN with --quick, else from FULL_RUN."""
    given = {"models": models or None, "batch_sizes": batch_sizes or None, "repeats": repeats,
             "warmup": warmup}
    defaults = QUICK_RUN if quick else FULL_RUN
    return {key: defaults[key] if value is None else value for key, value in given.items()}


def runtime_contenders() -> tuple[list[str], dict[str, str]]:
    """The contenders --runtimes adds on this machine, and those it cannot time with the reason."""
    from .. import bench as B
    from ..bench_runtimes import available
    from ..cpu.hardware import cpu_has_native_bf16

    add, skipped = [], {}
    for name in ("vitkit-bf16", *B.RUNTIME_CONTENDERS):
        if name.endswith("bf16") and not cpu_has_native_bf16():
            skipped[name] = "this CPU has no native bf16"
        elif name in B.RUNTIMES and not available(name):
            skipped[name] = "its runtime is not installed: pip install 'vitkit[bench-runtimes]'"
        else:
            add.append(name)
    return add, skipped


def bench(
    model: list[str] = typer.Option(
        [], "--model", "-m", help="Preset to measure; repeat for several. Default: ViT-S/16 and ViT-B/16 "
                                  "(ViT-S/16 with --quick)."),
    batch: list[int] = typer.Option(
        [], "--batch", "-b", help="Batch size; repeat for several. Default: 1 and 16 (1 with --quick)."),
    contender: list[str] = typer.Option(
        [], "--contender", "-c",
        help="Implementation to time; repeat for several. Default: all of vitkit, vitkit-fp32-opt, "
             "vitkit-int8, timm, hf-eager, hf-sdpa, torchvision; vitkit-bf16 on request (GPU or a CPU "
             "with native bf16)."),
    repeats: int | None = typer.Option(None, "--repeats", "-r", min=1, show_default=False,
                                help="Timed calls per contender and cell (median kept). Default: 10 (3 with "
                                     "--quick)."),
    warmup: int | None = typer.Option(None, "--warmup", min=0, show_default=False,
                               help="Untimed calls per contender before timing. Default: 2 (1 with "
                                    "--quick)."),
    settle: int = typer.Option(1, "--settle", min=0,
                               help="Untimed calls of a contender just before each timed one, after 0.1 s "
                                    "of quiet, so that it is timed on its own warm threads, not beside the "
                                    "still-spinning threads of the contender before it (0: right after "
                                    "another contender's call, no pause)."),
    threads: int = typer.Option(0, "--threads", "-t", min=0,
                                help="CPU threads (0: torch's default, all cores)."),
    quick: bool = typer.Option(False, "--quick", "-q",
                               help="A quick look: ViT-S/16, batch 1, 3 repeats, 1 warm-up (about a minute); "
                                    "-m, -b, -r and --warmup still choose."),
    json_path: Path = typer.Option(None, "--json",
                                   help="Also write the full results (every time) as JSON here."),
    runtimes: bool = typer.Option(False, "--runtimes",
                                  help="Also time what a deploying user would run instead: ONNX Runtime and "
                                       "OpenVINO at fp32, int8 and (on a CPU with native bf16) bf16, and "
                                       "timm through torch.compile; vitkit-bf16 beside OpenVINO's bf16. "
                                       "pip install 'vitkit[bench-runtimes]'."),
) -> None:
    """Inference speed of vitkit against timm, Hugging Face and torchvision, in one process.

    All contenders have random weights and the same architecture. Repetitions are interleaved in a fresh
    random order each round and medians are reported, so the ratios hold on a busy machine.

    MFU: the model's FLOP rate over the fp32 SGEMM rate of a 2048^3 torch.mm timed in the same loop.

    Try `vitkit bench --quick` first (about a minute). The full default run (2 models x 2 batch sizes x 7
    contenders x 10 repeats, each timed call after an untimed one) takes 30-60 minutes on 2 cores. On a busy
    machine `--threads 1` is steadier.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .. import bench as B
    from ..config import get_preset
    from .main import UsageError

    run = run_settings(quick, model, batch, repeats, warmup)
    contenders = list(contender) or list(B.CONTENDERS)
    if runtimes:
        extra, skipped = runtime_contenders()
        contenders += [c for c in extra if c not in contenders]
        for name, why in skipped.items():
            typer.echo(f"note: {name} is not timed: {why}", err=True)
    config = B.BenchConfig(models=tuple(run["models"]), batch_sizes=tuple(run["batch_sizes"]),
                           repeats=run["repeats"], warmup=run["warmup"], settle=settle,
                           contenders=tuple(contenders), threads=threads or None)

    for name in config.models:
        get_preset(name)  # an unknown name fails here, before minutes of measuring
    if json_path is not None and not json_path.parent.exists():
        raise UsageError(f"{json_path.parent}: no such folder for --json", "create it or choose another path")
    console = Console(width=130)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("timing", total=None)
        report = B.run(config,
                       on_progress=lambda done, total: progress.update(task, completed=done, total=total))
    console.print(B.format_table(report))
    for line in B.summarize(report):
        console.print(line)
    if json_path is not None:
        B.write_json(report, json_path)
        console.print(f"results written to {json_path}")


# what `vitkit export --to FORMAT` writes: the file's suffix, and the format's name in messages
EXPORT_FORMATS = {"onnx": (".onnx", "ONNX"), "openvino": (".xml", "OpenVINO IR")}


def export_target(to: str | None, output: Path) -> tuple[str, Path]:
    """The format `vitkit export` writes and the file it writes it to. The format is --to, else the output's
    suffix says (.xml: openvino, anything else: onnx); an output without a suffix gets the format's."""
    from .main import UsageError

    if to is not None and to not in EXPORT_FORMATS:
        raise UsageError(f"unknown format --to {to!r}", f"choose from {', '.join(EXPORT_FORMATS)}")
    by_suffix = {suffix: name for name, (suffix, _) in EXPORT_FORMATS.items()}
    fmt = to or by_suffix.get(output.suffix, "onnx")
    suffix, title = EXPORT_FORMATS[fmt]
    if not output.suffix:
        return fmt, output.with_suffix(suffix)
    if output.suffix != suffix:
        if to is None:
            raise UsageError(f"{output.name}: an export ends in .onnx (ONNX) or .xml (OpenVINO IR)")
        other = by_suffix.get(output.suffix)
        means = f", {output.suffix} is {EXPORT_FORMATS[other][1]} (--to {other})" if other else ""
        raise UsageError(f"--to {to} does not match {output.name}: {title} files end in {suffix}{means}")
    return fmt, output


def report_check(result, path: Path, runtime: str, atol: float) -> None:
    """Print the check's line (`ExportCheck`), or raise ValueError where the runtime differs from PyTorch."""
    diffs = ", ".join(f"batch {b}: {d:.2e}" for b, d in result.max_abs_diff.items())
    how = (f"{atol:g} x largest logit {result.max_abs_logit:.3g}" if result.max_abs_logit > 1 else
           f"{atol:g} absolute, the largest logit {result.max_abs_logit:.3g} being below 1")
    if not result.ok:
        raise ValueError(f"{path}: {runtime} differs from PyTorch by up to {result.worst:.2e} "
                         f"> {result.tolerance:.2e} ({how}; {diffs})")
    typer.echo(f"{runtime} matches PyTorch: max |diff| {diffs} (tolerance {result.tolerance:.2e}: {how})")
    if result.max_abs_logit == 0:
        typer.echo("note: every logit is 0 (an untrained, zero-initialised head), so the check compared "
                   "zeros")


def export(
    checkpoint: Path = typer.Argument(...,
                                      help="A vitkit checkpoint folder (or anything `vitkit info` reads)."),
    output: Path = typer.Argument(..., help="The file to write: model.onnx (ONNX), or model.xml (OpenVINO "
                                            "IR, its weights beside it in model.bin)."),
    to: str = typer.Option(None, "--to", show_default=False,
                           help="onnx or openvino. Default: from the output's suffix (.xml: openvino, else "
                                "onnx)."),
    check: bool = typer.Option(True, "--check/--no-check",
                               help="Run the file with onnxruntime or OpenVINO and compare it with PyTorch."),
    atol: float = typer.Option(1e-4, "--atol", min=0.0, help="Largest difference of the logits allowed, "
                               "relative to the largest logit (absolute where the logits stay below 1)."),
    opset: int = typer.Option(0, "--opset", min=0,
                              help="ONNX opset, 17 or newer (0: the exporter's default)."),
) -> None:
    """Export a checkpoint to ONNX (dynamo exporter) or OpenVINO IR (converted from that ONNX), with a dynamic
    batch axis, and check it with onnxruntime or OpenVINO's CPU runtime at fp32.

    The file takes normalised pixel_values (batch, C, H, W) and returns logits; the checkpoint's preprocessing
    and class names are stored in its metadata (the IR's runtime info). OpenVINO: pip install
    'vitkit[openvino]'.
    """
    from .. import load
    from ..export import check_onnx, check_openvino, export_onnx, export_openvino
    from .main import UsageError

    fmt, output = export_target(to, output)
    if fmt == "openvino" and opset:
        raise UsageError("--opset is for ONNX files, not OpenVINO IR")
    model = load(checkpoint)
    cfg, class_names = model.cfg, getattr(model, "class_names", None)
    if fmt == "openvino":
        path = export_openvino(model, output, class_names=class_names)
        files = [path, path.with_suffix(".bin")]
    else:
        path = export_onnx(model, output, class_names=class_names, opset=opset or None)
        files = [path]
    size = sum(f.stat().st_size for f in files) / 1e6
    typer.echo(f"wrote {' + '.join(map(str, files))} ({size:.1f} MB), input pixel_values (batch, "
               f"{cfg.in_chans}, {cfg.image_size[0]}, {cfg.image_size[1]}), output logits")
    if check:
        if fmt == "openvino":
            report_check(check_openvino(model, path, atol=atol), path, "OpenVINO (CPU, f32)", atol)
        else:
            report_check(check_onnx(model, path, atol=atol), path, "onnxruntime", atol)


def register(app: typer.Typer) -> None:
    app.command()(bench)
    app.command()(export)
