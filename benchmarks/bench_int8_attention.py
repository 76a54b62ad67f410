r"""What the choice of the int8 block's attention kernel buys: `vitkit.optimize(model, "int8")` inference with
the block operator's attention on the kernel the timing picks (vitkit.cpu.int8.int8_block_attention) against
the same model with it on each kernel in turn (vitkit's fp32 kernel, SDPA's in fp32 and, on CPUs with native
bf16, in bf16), ViT-S/16 and ViT-B/16 at batch 1 and 16, in one process with the rounds interleaved in a fresh
random order; each ratio is paired (the median over rounds of that kernel's time over the chosen one's).

    .venv/bin/python benchmarks/bench_int8_attention.py --threads 2 \
        --json benchmarks/results/int8-attention_CPU_DATE.json

Without the int8 block operator (no C++ compiler, VITKIT_KERNELS=0) there is nothing to choose: it says so.
"""

from __future__ import annotations

import random
import statistics
import sys
from collections.abc import Callable
from unittest import mock

import torch
import torch.nn as nn

import vitkit
import vitkit.cpu.int8 as int8
from vitkit.bench import build_vitkit, cells_parser, interleaved_times, machine_info, paired_ratio, write_json
from vitkit.cpu.build import int8_block_available
from vitkit.cpu.hardware import cpu_has_native_bf16


def kernels() -> list[str]:
    """The int8 block's attention kernels on this CPU."""
    return [k for k in int8.INT8_BLOCK_ATTENTION if k != "sdpa-bf16" or cpu_has_native_bf16()]


def int8_call(model: nn.Module, x: torch.Tensor, kernel: str | None) -> tuple[Callable[[], None], str]:
    """One int8 forward of `model` with the block's attention on `kernel` (None: the timing's choice), and the
    kernel it runs on."""
    fast = vitkit.optimize(model, "int8")
    real = int8.int8_block_attention
    last = {}  # the kernel of the last block called

    def attention(block, tokens, shares):
        last["kernel"] = kernel or real(block, tokens, shares)
        return last["kernel"]

    def call() -> None:
        with torch.inference_mode(), mock.patch.object(int8, "int8_block_attention", attention):
            fast(x)

    call()  # the kernel (and the int8 layers' engines) are timed and chosen on the first call
    return call, last["kernel"]


def main(argv: list[str] | None = None) -> list[dict]:
    args = cells_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not int8_block_available():
        sys.exit("bench_int8_attention: the int8 block operator is not available here (no C++ compiler, or "
                 "VITKIT_KERNELS=0), so its attention has no kernel to choose")
    vitkit.retain_freed_memory()
    rng = random.Random(0)
    rows = []
    print(f"the int8 block's attention kernels here: {', '.join(kernels())}")
    for name in args.model or ["ViT-S/16", "ViT-B/16"]:
        cfg = vitkit.get_config(name, num_classes=1000)
        torch.manual_seed(0)
        model = build_vitkit(cfg, fast=False).eval()  # plain, random weights: optimized once per kernel
        for batch in args.batch or [1, 16]:
            x = torch.randn(batch, cfg.in_chans, *cfg.image_size)
            chosen_call, chosen = int8_call(model, x, None)
            calls = {"chosen": chosen_call, **{k: int8_call(model, x, k)[0] for k in kernels()}}
            times = interleaved_times(calls, args.repeats, args.warmup, rng)
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            speedup = {k: paired_ratio(times["chosen"], [times[k]]) for k in kernels()}
            rows.append({"model": name, "batch": batch, "chosen": chosen, "ms": ms,
                         "chosen_over": speedup})
            print(f"{name} b{batch:<3d} chosen {chosen}: {ms['chosen']:.1f} ms; "
                  + "; ".join(f"{k} {ms[k]:.1f} ms ({speedup[k]:.3f}x)" for k in kernels()), flush=True)
    if args.json:
        write_json({"machine": machine_info(), "threads": torch.get_num_threads(), "repeats": args.repeats,
                    "kernels": kernels(), "rows": rows}, args.json)
    return rows


if __name__ == "__main__":
    main()
