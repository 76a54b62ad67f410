r"""What the choice of int8 engine buys: `vitkit.optimize(model, "int8")` inference with each layer on the
engine the timing picks (fbgemm or oneDNN, vitkit.cpu.int8.int8_engines) against the same model on fbgemm
alone, ViT-S/16 and ViT-B/16 at batch 1 and 16, in one process with the rounds interleaved in a fresh random
order; the ratio is paired (the median over rounds of the fbgemm time over the chosen engines' time).

    .venv/bin/python benchmarks/bench_int8_engines.py --threads 2 \
        --json benchmarks/results/int8-engines_CPU_DATE.json

On a CPU without VNNI, or a torch without oneDNN's quantized engine, both models are fbgemm's (ratio 1).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from unittest import mock

import torch

import vitkit
import vitkit.cpu.int8 as int8
from vitkit.bench import build_vitkit, cells_parser, interleaved_times, machine_info, paired_ratio, write_json


def int8_call(cfg, batch: int, fbgemm_only: bool) -> tuple[Callable[[], None], list[str]]:
    """One int8 forward of a model with random weights, and the engine each linear layer uses at this
    batch."""
    torch.manual_seed(0)
    if fbgemm_only:
        with mock.patch.object(int8, "int8_engines", lambda: ("fbgemm",)):
            fast = build_vitkit(cfg, "int8")
    else:
        fast = build_vitkit(cfg, "int8")
    x = torch.randn(batch, cfg.in_chans, *cfg.image_size)

    def call() -> None:
        with torch.inference_mode():
            fast(x)

    call()  # the engines are timed and chosen on the first call
    layers = [m for m in fast.modules() if isinstance(m, int8.DynamicInt8Linear)]
    rows = -(-batch * cfg.num_tokens // torch.get_num_threads())  # a share of the int8 block operator
    chosen = [next(e for e, p in m.packs.items() if p is m.packed(rows)) for m in layers]
    return call, chosen


def main(argv: list[str] | None = None) -> list[dict]:
    args = cells_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    vitkit.retain_freed_memory()
    rng = random.Random(0)
    rows = []
    print(f"int8 engines here: {', '.join(int8.int8_engines())} (the first is the default)")
    for name in args.model or ["ViT-S/16", "ViT-B/16"]:
        cfg = vitkit.get_config(name, num_classes=1000)
        for batch in args.batch or [1, 16]:
            chosen_call, chosen = int8_call(cfg, batch, fbgemm_only=False)
            fbgemm_call, _ = int8_call(cfg, batch, fbgemm_only=True)
            times = interleaved_times({"chosen": chosen_call, "fbgemm": fbgemm_call}, args.repeats,
                                      args.warmup, rng)
            ratio = paired_ratio(times["chosen"], [times["fbgemm"]])
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            counts = {e: chosen.count(e) for e in sorted(set(chosen))}
            rows.append({"model": name, "batch": batch, "ms_chosen": ms["chosen"], "ms_fbgemm": ms["fbgemm"],
                         "speedup": ratio, "layers_by_engine": counts})
            print(f"{name} b{batch:<3d} chosen {ms['chosen']:8.1f} ms  fbgemm only {ms['fbgemm']:8.1f} ms  "
                  f"{ratio:.3f}x  layers: {counts}", flush=True)
    if args.json:
        write_json({"machine": machine_info(), "threads": torch.get_num_threads(), "repeats": args.repeats,
                    "engines": list(int8.int8_engines()), "rows": rows}, args.json)
    return rows


if __name__ == "__main__":
    main()
