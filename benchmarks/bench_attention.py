"""The attention operators on their AVX-512 register tiles against the same operators on MKL's sgemm
(src/vitkit/cpu/csrc/attention.cpp), in one process: the operators alone, and with --models whole models,
inference and the training step. Each round runs both ways in a fresh random order; the ratio is paired (the
median over rounds of sgemm's time over the tiles' in the same round), so above 1 means the tiles are faster.

    .venv/bin/python benchmarks/bench_attention.py --threads 2                 # the operators, the ViT shapes
    .venv/bin/python benchmarks/bench_attention.py --threads 2 --models        # and the models
    .venv/bin/python benchmarks/bench_attention.py --threads 2 --models --json attention.json

The tiles serve head widths in multiples of 16 up to 128 on CPUs with AVX-512 (every ViT preset); elsewhere
both ways are sgemm and the script says so.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import vitkit
from vitkit.bench import interleaved_times, paired_ratio, write_json
from vitkit.cpu.attention import keeps_probabilities, sgemm_products
from vitkit.cpu.build import attention_available

# (name, batch, tokens, width, heads) of the attention in each model, as it runs: ViT-S/16 and ViT-B/16 at 224
# px; the fashion-mnist recipe in training (49 patches, half dropped, and the class token); the demo recipe.
OPERATOR_CELLS = (
    ("ViT-S/16 b1", 1, 197, 384, 6),
    ("ViT-S/16 b8", 8, 197, 384, 6),
    ("ViT-B/16 b1", 1, 197, 768, 12),
    ("fashion-mnist b256", 256, 25, 64, 4),
    ("demo b128", 128, 17, 128, 4),
)


def on_sgemm(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` within sgemm_products(): the model's attention on sgemm."""
    def call() -> object:
        with sgemm_products():
            return fn()

    return call


def timed_pair(calls: dict[str, Callable[[], object]], repeats: int, warmup: int, rng: random.Random) -> dict:
    """Medians (ms) of calls["tiles"] and calls["sgemm"], interleaved, and the paired speed-up of the tiles."""
    times = interleaved_times(calls, repeats, warmup, rng)
    return {"ms_tiles": 1e3 * statistics.median(times["tiles"]), "ms_sgemm": 1e3 * statistics.median(times["sgemm"]),
            "tiles_speedup": paired_ratio(times["tiles"], [times["sgemm"]])}


def operator_calls(batch: int, tokens: int, width: int, heads: int) -> tuple[int, dict[str, Callable[[bool], object]]]:
    """The operators of one cell, each a function of `tiles`: forward (inference: the softmax not kept), forward
    keeping the softmax (training, where it is kept) and backward; each calls its operator `calls` times (the
    first value), to ~20 images, so that one timing is not a few microseconds."""
    ops = torch.ops.vitkit
    torch.manual_seed(0)
    head_dim = width // heads
    scale = head_dim ** -0.5
    qkv = torch.randn(batch, tokens, 3 * width)
    grad = torch.randn(batch, tokens, width)
    keep = keeps_probabilities(tokens, head_dim)
    calls = max(1, 20 // batch)
    saved = {tiles: ops.attention_forward(qkv, heads, scale, keep, tiles) for tiles in (True, False)}

    def forward(keep_probs: bool) -> Callable[[bool], object]:
        return lambda tiles: [ops.attention_forward(qkv, heads, scale, keep_probs, tiles) for _ in range(calls)]

    def backward(tiles: bool) -> object:
        return [ops.attention_backward(grad, qkv, *saved[tiles], heads, scale, tiles) for _ in range(calls)]

    return calls, {"forward": forward(False), **({"forward, softmax kept": forward(True)} if keep else {}),
                   "backward": backward}


def operator_rows(repeats: int, warmup: int, rng: random.Random) -> list[dict]:
    rows = []
    for name, batch, tokens, width, heads in OPERATOR_CELLS:
        calls, measures = operator_calls(batch, tokens, width, heads)
        for what, fn in measures.items():
            r = timed_pair({"tiles": lambda fn=fn: fn(True), "sgemm": lambda fn=fn: fn(False)}, repeats, warmup, rng)
            rows.append({"cell": name, "measure": what, "calls": calls, **r})
            print(f"{name:>20} {what:<22} tiles {r['ms_tiles'] / calls:8.3f} ms  sgemm {r['ms_sgemm'] / calls:8.3f} ms"
                  f"  tiles {r['tiles_speedup']:.3f}x", flush=True)
    return rows


def model_rows(repeats: int, warmup: int, rng: random.Random) -> list[dict]:
    """Inference (the accelerated model, vitkit.accelerate, and optimize(fp32)) and the accelerated model's
    training step (forward, backward, AdamW): the plain model runs none of vitkit's operators."""
    rows = []

    def report(name: str, what: str, fn: Callable[[], object], reps: int) -> None:
        r = timed_pair({"tiles": fn, "sgemm": on_sgemm(fn)}, reps, warmup, rng)
        rows.append({"cell": name, "measure": what, **r})
        print(f"{name:>20} {what:<22} tiles {r['ms_tiles']:8.1f} ms  sgemm {r['ms_sgemm']:8.1f} ms"
              f"  tiles {r['tiles_speedup']:.3f}x", flush=True)

    for preset, batch in (("ViT-S/16", 1), ("ViT-B/16", 1), ("ViT-S/16", 16)):
        cfg = vitkit.get_config(preset)
        x = torch.randn(batch, cfg.in_chans, *cfg.image_size)
        accelerated = vitkit.accelerate(vitkit.create_model(cfg).eval())
        fast = vitkit.optimize(vitkit.create_model(cfg).eval(), "fp32", compile=False)
        reps = max(3, repeats // 4) if batch > 1 else repeats
        with torch.inference_mode():
            report(f"{preset} b{batch}", "inference, accelerated", lambda m=accelerated, x=x: m(x), reps)
            report(f"{preset} b{batch}", "inference, optimize", lambda m=fast, x=x: m(x), reps)

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_training import recipe_cell

    for cfg, batch in ((vitkit.get_config("ViT-S/16"), 8), recipe_cell("fashion-mnist"), recipe_cell("demo")):
        torch.manual_seed(0)
        model = vitkit.accelerate(vitkit.create_model(cfg).train())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(batch, cfg.in_chans, *cfg.image_size)
        y = torch.randint(0, cfg.num_classes, (batch,))

        def step(model=model, opt=opt, x=x, y=y) -> None:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        report(f"{cfg.name or 'ViT-S/16'} b{batch}", "training step", step, repeats)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--repeats", type=int, default=12, help="rounds per measurement (a quarter for batch 16)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--models", action="store_true", help="time whole models too, inference and training")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    if args.repeats < 1 or args.warmup < 0:
        p.error(f"--repeats must be at least 1 and --warmup at least 0, got {args.repeats} and {args.warmup}")
    if not attention_available():
        sys.exit("bench_attention: vitkit's attention operator is not available here (VITKIT_KERNELS=0, or no "
                 "C++ compiler to build it)")
    if args.threads:
        torch.set_num_threads(args.threads)
    tiled = [w // h for _, _, _, w, h in OPERATOR_CELLS if torch.ops.vitkit.attention_tiles_apply(w // h)]
    if not tiled:
        print("bench_attention: the register tiles do not apply on this CPU (no AVX-512): both ways are sgemm")
    rng = random.Random(0)
    print(f"threads {torch.get_num_threads()}; tiles against sgemm, paired over {args.repeats} rounds")
    rows = operator_rows(args.repeats, args.warmup, rng)
    if args.models:
        rows += model_rows(args.repeats, args.warmup, rng)
    if args.json:
        write_json({"threads": torch.get_num_threads(), "repeats": args.repeats, "tiles_apply": bool(tiled),
                    "rows": rows}, args.json)


if __name__ == "__main__":
    main()
