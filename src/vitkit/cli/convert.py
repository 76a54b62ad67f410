"""`vitkit convert SRC DST --to vitkit|timm|hf`: any checkpoint vitkit reads, written in another format."""

from __future__ import annotations

import warnings
from pathlib import Path

import typer


def convert(
    src: str = typer.Argument(...,
                              help="A checkpoint: vitkit folder, .npz, timm/torchvision .safetensors/.pth/"
                                   ".bin, Hugging Face or timm folder, or a hub name."),
    dst: Path = typer.Argument(..., help="Output folder (created; one that holds files is refused unless "
                                         "--force)."),
    to: str = typer.Option("vitkit", "--to", help="Output format: vitkit, timm (hub folder: config.json + "
                                                   "model.safetensors) or hf (transformers folder)."),
    image_size: str = typer.Option("", "--image-size", help="HxW (or N) of the source, needed only for a "
                                                             "non-square position table without a config."),
    num_heads: int = typer.Option(0, "--num-heads", min=0,
                                  help="Heads of the source (0: infer), needed only for a fused-q;k;v file "
                                       "without a config whose heads are not 64 wide."),
    pool: str = typer.Option("", "--pool", help="token or gap: the source's pooling, needed only for a file "
                                                 "without a config whose model averages the patch tokens and "
                                                 "keeps its class token (timm's global_pool='avg')."),
    force: bool = typer.Option(False, "--force", help="Write into DST even if it holds other files."),
) -> None:
    """Convert a ViT checkpoint between formats; the written tensors reproduce the source exactly.

    What the target library will compute differently is refused (a layer it lacks) or noted (timm's LayerNorm
    eps of 1e-6 for a model with a smaller one; transformers' preprocessing without a centre crop)."""
    from ..convert import TARGETS, write
    from ..loading import load
    from .main import UsageError

    if to not in TARGETS:
        raise UsageError(f"unknown format --to {to!r}", f"choose from {', '.join(TARGETS)}")
    if dst.exists() and not dst.is_dir():
        raise UsageError(f"{dst}: exists and is not a folder", "give a folder path for DST")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise UsageError(f"{dst}: folder is not empty", "pass --force to write into it anyway")
    size = _parse_size(image_size) if image_size else None
    model = load(src, image_size=size, num_heads=num_heads or None, pool=pool or None)
    with warnings.catch_warnings(record=True) as notes:  # what the target format will do differently
        warnings.simplefilter("always")
        try:
            write(model, dst, to=to, class_names=getattr(model, "class_names", None))
        except ValueError as e:
            raise UsageError(str(e), "pick another --to format") from None
    for note in notes:
        typer.echo(f"note: {note.message}", err=True)
    cfg = model.cfg
    typer.echo(f"{src} -> {dst} ({to}): {cfg.dim} wide, {cfg.depth} layers, {cfg.num_heads} heads, "
               f"{cfg.image_size[0]}x{cfg.image_size[1]} px, {cfg.num_classes} classes")


def _parse_size(text: str) -> tuple[int, int]:
    from .main import UsageError

    parts = text.lower().split("x")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise UsageError(f"--image-size {text!r} is not N or HxW",
                         "e.g. --image-size 384 or 224x320") from None
    if len(values) == 1:
        values *= 2
    if len(values) != 2 or min(values) < 1:
        raise UsageError(f"--image-size {text!r} is not N or HxW", "e.g. --image-size 384 or 224x320")
    return values[0], values[1]


def register(app: typer.Typer) -> None:
    app.command()(convert)
