"""Images per second read, decoded and augmented from tar shards against the same images as a folder.

A folder of ImageNet-sized JPEGs (500 x 375, random smooth content with noise, quality 90) is written once,
then sharded with `vitkit.data.shard_writer` (the files' bytes unchanged). Each round runs one epoch of the
trainer's own batch sources, vitkit.train.batches.LoaderBatches for the folder and ShardBatches for the
shards, with a recipe's training transform (pretrain's: RandomResizedCrop to 224 px and a flip), for 1 and 2
DataLoader workers. The four cells are measured in alternating rounds so that load from other processes falls
on each alike; the figure is the median over rounds of images per second (worker start-up included, as in
each epoch of a run).

    python benchmarks/bench_data_read.py --json benchmarks/results/data-read_WHERE_DATE.json
    python benchmarks/bench_data_read.py --images 256 --rounds 3      # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def write_folder(root: Path, n: int, classes: int = 8) -> None:
    """`n` JPEGs of 500 x 375 in `classes` class folders: smooth colour fields plus noise."""
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / f"class{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        base = rng.integers(0, 255, (6, 8, 3)).astype(np.uint8)
        image = Image.fromarray(base).resize((500, 375), Image.BICUBIC)
        noisy = np.asarray(image).astype(np.int16) + rng.integers(-12, 12, (375, 500, 3))
        Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(folder / f"{i:05d}.jpg", quality=90)


def one_epoch(source, batch: int) -> float:
    """Images per second of one epoch of `source` (every step of one process)."""
    from vitkit.train.batches import make_plan, steps_per_epoch

    plan = make_plan(batch, 0, 1, 0)
    steps = steps_per_epoch(len(source), batch)
    t = time.perf_counter()
    for _ in source.epoch(0, plan, 0, steps):
        pass
    return steps * batch / (time.perf_counter() - t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="pretrain", help="whose model size and training augmentation")
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shard-size", default="10MB")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()

    from vitkit.data import resolve
    from vitkit.data.shard_writer import parse_size, shard_pattern, write_shards
    from vitkit.data.shards import open_shards
    from vitkit.train.batches import LoaderBatches, ShardBatches
    from vitkit.train.recipes import get_recipe

    torch.set_num_threads(1)  # the DataLoader's own setting for its workers; the main process only waits
    cfg = get_recipe(args.recipe)
    with tempfile.TemporaryDirectory() as tmp:
        write_folder(Path(tmp) / "folder", args.images)
        folder = resolve(Path(tmp) / "folder")
        index = write_shards(folder, Path(tmp) / "shards", parse_size(args.shard_size), progress=False)
        shards = open_shards(shard_pattern(index, Path(tmp) / "shards"))
        classes = len(folder.classes)
        sources = {}
        for workers in (1, 2):
            sources[f"folder/{workers}"] = LoaderBatches(folder, cfg.model, cfg.augment, classes, 0, workers)
            sources[f"shards/{workers}"] = ShardBatches(shards, cfg.model, cfg.augment, classes, 0, workers)
        one_epoch(sources["folder/1"], args.batch)  # warm the page cache and the imports
        one_epoch(sources["shards/1"], args.batch)
        times: dict[str, list[float]] = {k: [] for k in sources}
        for r in range(args.rounds):
            for name in (sorted(sources) if r % 2 == 0 else sorted(sources, reverse=True)):
                times[name].append(one_epoch(sources[name], args.batch))
        folder_bytes = sum(p.stat().st_size for p, _ in folder.samples)
    rows = [{"source": k.split("/")[0], "workers": int(k.split("/")[1]),
             "images_per_s": statistics.median(v), "rounds": v} for k, v in sorted(times.items())]
    for row in rows:
        print(f"{row['source']:7s} {row['workers']} worker(s): {row['images_per_s']:7.1f} images/s")
    if args.json:
        from records import cpu_model

        record = {"measured_with": f"python benchmarks/bench_data_read.py --images {args.images} --batch "
                                   f"{args.batch} --rounds {args.rounds} --shard-size {args.shard_size}",
                  "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                              "python": platform.python_version(), "torch": torch.__version__},
                  "recipe": args.recipe, "image_size": list(cfg.model.image_size),
                  "augment": {"crop": cfg.augment.crop, "hflip": cfg.augment.hflip},
                  "images": args.images, "bytes": folder_bytes, "shards": len(shards.paths),
                  "batch": args.batch, "rows": rows}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
