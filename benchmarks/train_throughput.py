"""Training throughput: vitkit's training loop driving vitkit's ViT vs the same loop driving timm's
VisionTransformer of the same size, on the same data (Fashion-MNIST held in memory, whole-batch
augmentation). timm's model is `vitkit.bench.build_timm`'s: fused attention, and the recipe's PatchDropout
(timm's `patch_drop_rate`), so both train on the same number of tokens; both run in the recipe's precision.

Both models go through vitkit.train's own pieces: the batch source, the weight-decay groups and AdamW,
`forward_backward` and `optimizer_step`, with the recipe's batch size; vitkit's model is accelerated
(vitkit.accelerate, on the CPU) as the training loop does. The two are measured in alternating
rounds (ours, timm, ours, timm, ...) so that load from other processes falls on both alike; the figure is the
median over rounds of images per second, and the ratio ours / timm (1.0 or more: ours is at least as fast).
`--compile` adds both models through torch.compile (as `--set compile=true` trains; the `fashion-mnist` recipe
does by default) to the rotation: vitkit's with its attention operator in the compiled graph.

    .venv/bin/python benchmarks/train_throughput.py                         # the fashion-mnist recipe's model
    .venv/bin/python benchmarks/train_throughput.py --recipe demo --rounds 5 --steps 20
    .venv/bin/python benchmarks/train_throughput.py --synthetic             # random images, no dataset needed
    .venv/bin/python benchmarks/train_throughput.py --threads 1 --batch-size 128 --compile  # 1 of 2 processes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import cpu_model  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="fashion-mnist", help="whose model, batch size and augmentation")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rounds", type=int, default=5, help="alternating measurement rounds per model")
    parser.add_argument("--steps", type=int, default=15, help="optimizer steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each round")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--synthetic", action="store_true",
                        help="random uint8 images instead of Fashion-MNIST")
    parser.add_argument("--compile", action="store_true",
                        help="also time both models through torch.compile (inductor)")
    parser.add_argument("--batch-size", type=int, default=0,
                        help="images per step (0: the recipe's; half of it is one of two processes' share)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    from vitkit.bench import build_timm
    from vitkit.cpu import accelerate
    from vitkit.data import FASHION_MNIST_CLASSES, TensorImageDataset, resolve
    from vitkit.model import VisionTransformer
    from vitkit.train.batches import batch_source, make_plan, steps_per_epoch
    from vitkit.train.losses import classification_loss
    from vitkit.train.one_step import autocast_dtype, forward_backward, optimizer_step
    from vitkit.train.optim import build_optimizer
    from vitkit.train.recipes import get_recipe

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = get_recipe(args.recipe, args.overrides)
    if args.synthetic:
        g = torch.Generator().manual_seed(0)
        n = 4096
        images = torch.randint(0, 256, (n, cfg.model.in_chans, *cfg.model.image_size), generator=g,
                               dtype=torch.uint8)
        data = TensorImageDataset(images, torch.randint(0, 10, (n,), generator=g), FASHION_MNIST_CLASSES)
    else:
        data = resolve(cfg.data.name, "train", cfg.data.data_dir)
    model_cfg = cfg.model.replace(num_classes=len(data.classes))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = autocast_dtype(cfg.precision, device)
    loss_fn = classification_loss(cfg.optim.loss, cfg.optim.label_smoothing)
    source = batch_source(data, model_cfg, cfg.augment, len(data.classes), cfg.seed)
    batch_size = args.batch_size or cfg.batch_size
    plan = make_plan(batch_size, cfg.micro_batch, 1, 0)
    per_epoch = steps_per_epoch(len(source), batch_size)

    def build(name: str) -> torch.nn.Module:
        if name == "vitkit":
            return accelerate(VisionTransformer(model_cfg).to(device))  # as the trainer runs it
        return build_timm(model_cfg).to(device)

    torch.manual_seed(0)
    models = {name: build(name) for name in ("vitkit", "timm")}
    n_params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    if n_params["vitkit"] != n_params["timm"]:
        raise SystemExit(f"the two models differ in size: {n_params}")
    optimizers = {k: build_optimizer(m, cfg.optim) for k, m in models.items()}
    nets = dict(models)  # what each step calls: the model, or its compiled wrapper (the same parameters)
    if args.compile:
        for name in list(models):
            torch.manual_seed(0)
            twin = build(name)
            models[name + "-compiled"], nets[name + "-compiled"] = twin, torch.compile(twin)
            optimizers[name + "-compiled"] = build_optimizer(twin, cfg.optim)
    batches = source.epoch(0, plan, 0, per_epoch)

    def next_batch():
        nonlocal batches
        try:
            return next(batches)[1]
        except StopIteration:
            batches = source.epoch(1, plan, 0, per_epoch)
            return next(batches)[1]

    def run(name: str, steps: int) -> float:
        """Images per second over `steps` full training steps (data, augmentation, forward, backward,
        AdamW)."""
        model, net, opt = models[name], nets[name], optimizers[name]
        model.train()
        start = time.perf_counter()
        for _ in range(steps):
            batch = next_batch()
            if not name.startswith("vitkit"):  # timm's model draws its masks from torch's generator
                batch = [(x, y) for x, y, _ in batch]
            loss = forward_backward(net, batch, loss_fn, device, amp)
            optimizer_step(model, opt, cfg.optim.clip_grad_norm)
        float(loss)  # wait for the device
        return steps * batch_size / (time.perf_counter() - start)

    rates: dict[str, list[float]] = {name: [] for name in models}
    print(f"{args.recipe}: {model_cfg.dim} wide, {model_cfg.depth} deep, {model_cfg.num_tokens} tokens, "
          f"{n_params['vitkit']:,} parameters, batch {batch_size}, {torch.get_num_threads()} threads, "
          f"{device}")
    for name in models:  # the compilation, and the first steps, before any timing
        run(name, args.warmup)
    for r in range(args.rounds):
        for name in list(models) if r % 2 == 0 else list(models)[::-1]:
            run(name, args.warmup)
            rates[name].append(run(name, args.steps))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f} img/s" for k, v in rates.items()), flush=True)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    print("median: " + ", ".join(f"{k} {v:.0f} img/s" for k, v in medians.items()))
    pairs = [("vitkit", "timm")] + ([("vitkit-compiled", "timm-compiled"), ("vitkit-compiled", "vitkit")]
                                   if args.compile else [])
    ratios = {}
    for a, b in pairs:
        per_round = [x / y for x, y in zip(rates[a], rates[b], strict=True)]
        ratios[f"{a}/{b}"] = statistics.median(per_round)
        print(f"{a} / {b}: {statistics.median(per_round):.2f}x (per round {min(per_round):.2f}-"
              f"{max(per_round):.2f}x)")
    report = {"recipe": args.recipe, "overrides": args.overrides, "batch_size": batch_size,
              "vitkit_img_s": medians["vitkit"], "timm_img_s": medians["timm"],
              "ratio": medians["vitkit"] / medians["timm"], "medians": medians, "paired_ratios": ratios,
              "rounds": rates, "threads": torch.get_num_threads(), "cpu": cpu_model(), "device": str(device)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
