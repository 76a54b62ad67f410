r"""What each of vitkit's compiled CPU operators buys, as whole-model figures, in one interleaved run.

For each operator, the same model is timed with and without it in one process, the rounds interleaved in a
fresh random order; the ratio is paired (the median over rounds of the time without over the time with):

- the attention operator (`torch.ops.vitkit.attention_forward/backward`, vitkit.cpu.attention): the training
  step (forward, loss, backward, AdamW) of an accelerated ViT-S/16 at batch 8 and of the `fashion-mnist` and
  `demo` recipes' models at their batch sizes, and `vitkit.optimize(model, "fp32")` inference of ViT-S/16 at
  batch 1 and 16; "without" is the same model with VITKIT_KERNELS=0 for the call (SDPA or the explicit
  products instead);
- the int8 block operator (`torch.ops.vitkit.int8_block`, vitkit.cpu.int8): `vitkit.optimize(model, "int8")`
  inference of ViT-S/16 and ViT-B/16 at batch 1 and 16, against the same int8 model run operator by operator;
- the fp32 block operator (`torch.ops.vitkit.fp32_block`, vitkit.cpu.fp32_block; AVX-512 or AVX2):
  `vitkit.optimize(model, "fp32")` inference of ViT-S/16 and ViT-B/16 at batch 1 and 16, against the same
  model's blocks run layer by layer;
- the bf16 block operator (`torch.ops.vitkit.bf16_block`, vitkit.cpu.bf16_block; CPUs with AVX512-BF16): the
  same with `vitkit.optimize(model, "bf16")`.

An operator stays in vitkit where it buys at least 5 % of one of these figures on one of the CPU kinds vitkit
runs on (docs/speed.md). Run:

    .venv/bin/python benchmarks/bench_operators.py --threads 2 \
        --json benchmarks/results/operators_CPU_DATE.json

(`--operator fp32_block` measures one operator's cells alone; the bf16 block's cells need a CPU with native
bf16.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

import vitkit
from vitkit.bench import build_vitkit, machine_info, write_json
from vitkit.cpu.build import DISABLE_ENV
from vitkit.cpu.hardware import cpu_has_native_bf16
from vitkit.timing import interleaved_times, paired_ratio
from vitkit.train.optim import build_optimizer


@contextlib.contextmanager
def kernels_off(off: bool):
    """VITKIT_KERNELS=0 within the block (read at every call by the attention; at optimize() by int8)."""
    if not off:
        yield
        return
    before = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[DISABLE_ENV]
        else:
            os.environ[DISABLE_ENV] = before


def training_step(cfg, batch: int, off: bool) -> Callable[[], None]:
    from vitkit.train.recipes import OptimConfig

    torch.manual_seed(0)
    model = build_vitkit(cfg).train()  # accelerated, its head random, as vitkit bench builds it
    opt = build_optimizer(model, OptimConfig())
    x = torch.randn(batch, cfg.in_chans, *cfg.image_size)
    y = torch.randint(0, cfg.num_classes, (batch,))

    def step() -> None:
        with kernels_off(off):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

    return step


def inference_call(cfg, batch: int, precision: str, off: bool) -> Callable[[], None]:
    torch.manual_seed(0)
    with kernels_off(off):
        fast = build_vitkit(cfg, precision)  # vitkit.optimize's model, as vitkit bench builds it
    x = torch.randn(batch, cfg.in_chans, *cfg.image_size)

    def call() -> None:
        with kernels_off(off), torch.inference_mode():
            fast(x)

    return call


# the block operators: precision, the FusedBlock's operands, the CPU they need
BLOCK_OPERATORS = {"fp32_block": ("fp32", "fp32_operands", "an AVX-512 or AVX2 CPU"),
                   "bf16_block": ("bf16", "bf16_operands", "a CPU with AVX512-BF16")}


@contextlib.contextmanager
def layer_by_layer(operator: str, off: bool):
    """Within the block every FusedBlock runs its layers (`off`) or the block operator (fp32_block or
    bf16_block), whatever the timing chose."""
    from vitkit.cpu import fused_block

    name = f"{operator}_chosen"
    chosen = getattr(fused_block, name)
    setattr(fused_block, name, lambda block, x: not off)
    try:
        yield
    finally:
        setattr(fused_block, name, chosen)


def block_operator_call(operator: str, cfg, batch: int, off: bool) -> Callable[[], None]:
    precision, operands, cpu = BLOCK_OPERATORS[operator]
    torch.manual_seed(0)
    fast = build_vitkit(cfg, precision)
    if not any(getattr(b, operands, None) is not None for b in fast.blocks):
        raise SystemExit(f"the {operator} operator does not run here (it needs {cpu})")
    x = torch.randn(batch, cfg.in_chans, *cfg.image_size)

    def call() -> None:
        with layer_by_layer(operator, off), torch.inference_mode():
            fast(x)

    return call


def paired(calls: dict[str, Callable[[], None]], repeats: int, warmup: int, rng: random.Random):
    """The median ms of "with" and "without", and the paired ratio without/with (vitkit.bench's method)."""
    times = interleaved_times(calls, repeats, warmup, rng)
    ratio = paired_ratio(times["with"], [times["without"]])
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}, ratio


def cells(quick: bool):
    from vitkit.train.recipes import get_recipe

    vit_s, vit_b = (vitkit.get_config("ViT-S/16", num_classes=1000),
                    vitkit.get_config("ViT-B/16", num_classes=1000))
    out = []
    for name in ("fashion-mnist", "demo"):
        r = get_recipe(name)
        out.append(("attention", f"train {name} b{r.batch_size}",
                    lambda off, c=r.model, b=r.batch_size: training_step(c, b, off)))
    out.append(("attention", "train ViT-S/16 b8", lambda off: training_step(vit_s, 8, off)))
    for b in (1, 16):
        out.append(("attention", f"optimize(fp32) ViT-S/16 b{b}",
                    lambda off, b=b: inference_call(vit_s, b, "fp32", off)))
    for cfg in (vit_s,) if quick else (vit_s, vit_b):
        for b in (1, 16):
            out.append(("int8_block", f"optimize(int8) {cfg.name} b{b}",
                        lambda off, c=cfg, b=b: inference_call(c, b, "int8", off)))
    for operator, (precision, _, _) in BLOCK_OPERATORS.items():
        if precision == "bf16" and not cpu_has_native_bf16():
            continue
        for cfg in (vit_s,) if quick else (vit_s, vit_b):
            for b in (1, 16):
                out.append((operator, f"optimize({precision}) {cfg.name} b{b}",
                            lambda off, o=operator, c=cfg, b=b: block_operator_call(o, c, b, off)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--repeats", type=int, default=10, help="interleaved rounds per cell")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls of each contender first")
    p.add_argument("--quick", action="store_true",
                   help="ViT-S/16 only for int8 and the block operators, 4 rounds")
    p.add_argument("--operator", default=None, choices=("attention", "int8_block", *BLOCK_OPERATORS),
                   help="measure this operator's cells only")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    vitkit.retain_freed_memory()
    repeats = 4 if args.quick else args.repeats
    rng = random.Random(0)
    rows = []
    todo = [cell for cell in cells(args.quick) if not args.operator or cell[0] == args.operator]
    if not todo:
        raise SystemExit(f"the {args.operator} operator does not run here (it needs "
                         f"{BLOCK_OPERATORS[args.operator][2]})")
    for operator, label, build in todo:
        ms, ratio = paired({"with": build(False), "without": build(True)}, repeats, args.warmup, rng)
        rows.append({"operator": operator, "cell": label, "ms_with": ms["with"], "ms_without": ms["without"],
                     "speedup": ratio})
        print(f"{operator:11s} {label:32s} with {ms['with']:8.2f} ms  without {ms['without']:8.2f} ms  "
              f"{ratio:.3f}x", flush=True)
    if args.json:
        write_json({"machine": machine_info(), "threads": torch.get_num_threads(), "repeats": repeats,
                    "rows": rows}, args.json)


if __name__ == "__main__":
    main()
