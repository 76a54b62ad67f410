"""`vitkit shard SRC OUT`: a dataset vitkit reads, written as WebDataset-style tar shards for training."""

from __future__ import annotations

import re
from pathlib import Path

import typer


def shard(
    src: str = typer.Argument(..., help="An image folder (with or without train/ and test/ split folders), a "
                                        "dataset name (fashion-mnist, cifar10, cifar100) or a Hugging Face "
                                        "dataset folder (hf:FOLDER)."),
    out: Path = typer.Argument(..., help="Output folder for the shards and index.json (created; one that "
                                         "holds files is refused)."),
    shard_size: str = typer.Option("500MB", "--shard-size",
                                   help="Bytes per shard before the next one starts: 500MB, 1GB, 256MiB."),
    split: str = typer.Option("train", "--split", help="The split of SRC to write: train, test or val."),
    prefix: str = typer.Option("", "--prefix",
                               help="Shard names: PREFIX-000000.tar, ... (default: the split)."),
    seed: int = typer.Option(0, "--seed", help="Shuffles the order the samples are written in."),
    data_dir: Path | None = typer.Option(None, "--data-dir",
                                         help="Where a named dataset is looked for (and downloaded to)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="A progress bar on stderr."),
) -> None:
    """Write SRC as tar shards (`KEY.jpg`/`KEY.png` + `KEY.cls`) and OUT/index.json, to train on with
    `--set data.name=shards:PATTERN` (the pattern is printed at the end).

    A folder's image files go in unchanged; in-memory images (Fashion-MNIST, CIFAR, Hugging Face datasets) are
    encoded as PNG, losslessly. The samples are shuffled once, by --seed, so that each shard holds every
    class."""
    from ..data import resolve
    from ..data.shard_writer import parse_size, shard_pattern, write_shards
    from .main import UsageError

    try:
        max_bytes = parse_size(shard_size)
    except ValueError as e:
        raise UsageError(str(e), "e.g. --shard-size 500MB") from None
    if src.startswith("shards:"):
        raise UsageError(f"{src}: already shards", "give the folder or dataset they were written from")
    name = prefix or split
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise UsageError(f"--prefix {name!r}: shard names take letters, digits, - and _ only",
                         "e.g. --prefix in21k-train")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: exists and is not a folder", "give a new or empty folder for OUT")
    if out.is_dir() and any(out.iterdir()):
        raise UsageError(f"{out}: folder is not empty", "give a new or empty folder for OUT")
    dataset = resolve(src, split, data_dir)  # a missing SRC: FileNotFoundError, one line naming it
    index = write_shards(dataset, out, max_bytes, name, seed, progress, source=src)
    pattern = shard_pattern(index, out)
    typer.echo(f"{src} ({split}) -> {out}: {index['total']} images in {len(index['shards'])} shard(s), "
               f"{len(index['classes'])} classes")
    typer.echo(f"train on them with: --set data.name=shards:{pattern}")


def register(app: typer.Typer) -> None:
    app.command()(shard)
