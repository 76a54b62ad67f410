"""Products of few rows: MKL (`F.linear`) against oneDNN (plain and packed weights), and what taking MKL for
the per-image layers (the classifier, the last block's class-token layers: vitkit.cpu.packed.PackedLinear)
gains `optimize(fp32)` at small batches.

    .venv/bin/python benchmarks/bench_few_rows.py --threads 2 --json runs/few-rows.json

`layers`: each per-image layer shape of the model at 1, 2, 4, 8 and 16 rows, the three engines interleaved.
`tail`: the part of the optimized model those layers sit in (the last block for the class token, the final
LayerNorm and the classifier, from the previous block's output), with and without their plain weights,
interleaved; `model`: the whole optimized model the same way. Ratios are paired (vitkit.bench.paired_ratio):
how many times faster the few-rows path is than oneDNN throughout.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
import torch.nn.functional as F

import vitkit
from vitkit import bench
from vitkit.cpu.packed import PackedLinear
from vitkit.cpu.private import onednn_linear, pack_weight
from vitkit.inference import optimize

ROWS = (1, 2, 4, 8, 16)


def per_image_layers(fast: torch.nn.Module) -> list[PackedLinear]:
    """The layers of the optimized model `fast` that multiply one row per image: the last block's, after its
    attention (the class token's query, output projection, MLP), and the classifier."""
    last = fast.blocks[-1]
    layers = [m for name, m in last.named_modules()
              if isinstance(m, PackedLinear) and not name.endswith("qkv")]
    return layers + ([fast.head] if isinstance(fast.head, PackedLinear) else [])


def layer_table(fast: torch.nn.Module, repeats: int, rng: random.Random) -> list[dict]:
    """Median microseconds of each per-image layer shape of the optimized model `fast` through MKL, oneDNN and
    oneDNN packed."""
    shapes = sorted({(m.in_features, m.out_features) for m in per_image_layers(fast)})
    table = []
    with torch.inference_mode():
        for fan_in, fan_out in shapes:
            w, b = torch.randn(fan_out, fan_in), torch.randn(fan_out)
            packed = pack_weight(w, 197)
            for n in ROWS:
                x = torch.randn(n, fan_in)
                calls = {
                    "mkl": lambda x=x, w=w, b=b: F.linear(x, w, b),
                    "onednn": lambda x=x, w=w, b=b: onednn_linear(x, w, b),
                    "onednn_packed": lambda x=x, p=packed, b=b: onednn_linear(x, p, b),
                }
                times = bench.interleaved_times(calls, repeats, 10, rng)
                row = {"in": fan_in, "out": fan_out, "rows": n}
                row.update({name: 1e6 * statistics.median(t) for name, t in times.items()})
                table.append(row)
                print(f"{fan_in:>5} -> {fan_out:<5} rows {n:>2}: " + "  ".join(
                    f"{name} {row[name]:7.0f} us" for name in calls), flush=True)
    return table


def optimize_without_plain_weights(model: vitkit.VisionTransformer) -> torch.nn.Module:
    """`optimize(model, "fp32")` with every packed layer through oneDNN, whatever the rows of a call."""
    other = optimize(model, "fp32")
    for m in other.modules():
        if isinstance(m, PackedLinear):
            m.engine = lambda x: "packed"
    return other


def tail(fast: vitkit.VisionTransformer, tokens: torch.Tensor) -> torch.Tensor:
    x, _ = fast.blocks[-1](tokens, queries=1)
    return fast.forward_head(fast.norm(x))


def compare(name: str, calls: dict, repeats: int, rng: random.Random) -> dict:
    times = bench.interleaved_times(calls, repeats, 3, rng)
    ratio = bench.paired_ratio(times["few_rows"], [times["onednn"]])
    result = {"part": name, "repeats": repeats, "ratio": ratio,
              **{f"{k}_ms": 1e3 * statistics.median(t) for k, t in times.items()}}
    print(f"{name}: few rows {result['few_rows_ms']:.3f} ms, oneDNN {result['onednn_ms']:.3f} ms, "
          f"paired ratio {ratio:.3f}x", flush=True)
    return result


def measure_batch(name: str, fast: vitkit.VisionTransformer, slow: vitkit.VisionTransformer, batch: int,
                  args: argparse.Namespace, rng: random.Random) -> list[dict]:
    """The tail (and the whole model) at one batch size, with and without the few-rows path."""
    images = torch.randn(batch, fast.cfg.in_chans, *fast.cfg.image_size)
    parts = []
    with torch.inference_mode():
        tokens = fast.embed(images)
        for block in fast.blocks[:-1]:
            tokens, _ = block(tokens)
        torch.testing.assert_close(tail(fast, tokens), tail(slow, tokens), rtol=0, atol=1e-4)
        calls = {"few_rows": lambda: tail(fast, tokens), "onednn": lambda: tail(slow, tokens)}
        parts.append({"batch": batch, **compare(f"{name} batch {batch} tail", calls, args.repeats, rng)})
        if args.model_repeats:
            calls = {"few_rows": lambda: fast(images), "onednn": lambda: slow(images)}
            parts.append({"batch": batch, **compare(f"{name} batch {batch} model", calls, args.model_repeats, rng)})
    return parts


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "-m", action="append", default=None, help="model presets (default ViT-S/16, ViT-B/16)")
    p.add_argument("--batch", "-b", action="append", type=int, default=None, help="batch sizes (default 1, 2)")
    p.add_argument("--repeats", "-r", type=int, default=200, help="rounds for the layers and the tail")
    p.add_argument("--model-repeats", type=int, default=30, help="rounds for the whole model (0: skip it)")
    p.add_argument("--threads", "-t", type=int, default=0, help="intra-op threads (default: torch's)")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    try:
        configs = [vitkit.get_config(name) for name in args.model or ["ViT-S/16", "ViT-B/16"]]
    except (KeyError, ValueError) as e:
        p.error(e.args[0] if e.args else str(e))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads_before)
    rng = random.Random(0)
    torch.manual_seed(0)
    report = {"machine": bench.machine_info(), "threads": torch.get_num_threads(), "models": []}
    try:
        for cfg in configs:
            model = vitkit.create_model(cfg).eval()
            fast, slow = optimize(model, "fp32"), optimize_without_plain_weights(model)
            entry = {"model": cfg.name, "layers": layer_table(fast, args.repeats, rng), "parts": []}
            for batch in args.batch or [1, 2]:
                entry["parts"] += measure_batch(cfg.name, fast, slow, batch, args, rng)
            report["models"].append(entry)
    finally:
        torch.set_num_threads(threads_before)
    if args.json:
        bench.write_json(report, args.json)
    return report


if __name__ == "__main__":
    main()
