"""Training-step speed (forward, loss, backward, AdamW) of vitkit against timm's VisionTransformer, eager
and through `torch.compile`.

Both models have the same architecture and random weights, train on the same random batch, and their steps
are timed interleaved in a fresh random order each round; img/s are medians, the ratio is paired (the median
over rounds of timm's time over vitkit's in the same round). The models: ViT-S/16 at 224 px, and the
models of the Fashion-MNIST recipes in vitkit.train.recipes (`fashion-mnist` and `demo`), at the recipes'
batch size, all in fp32.

The contenders: `vitkit` (accelerated, as the trainer runs it by default), `timm` (eager) and, unless
`--no-compile`, `timm-compiled` (timm's model through torch.compile, inductor, the way a timm user speeds up
training) and `vitkit-compiled` (the trainer's `compile=true` path: the accelerated model through
torch.compile). `trainer` names the path vitkit's trainer takes for the cell (compiled where the recipe sets
`compile`), and `ratio_trainer_over_timm_compiled` is that path against timm compiled.

    .venv/bin/python benchmarks/bench_training.py --threads 1                 # the table
    .venv/bin/python benchmarks/bench_training.py --threads 1 --profile       # where the time goes first
    .venv/bin/python benchmarks/bench_training.py --threads 2 --engines       # oneDNN and MKL side by side

vitkit's linear layers compute each training product on the engine that
vitkit.cpu.linear.training_engine_for chooses for its shape (timed once on this machine, cached on disk), as
the trainer runs them; `--engines` times vitkit on each engine alone as well (vitkit[onednn], vitkit[mkl]),
beside that default, whose ratio to timm stays the headline.

Both models step with the same optimizer, by default the one vitkit's trainer builds
(vitkit.train.optim.build_optimizer: AdamW, fused where torch has it, weight decay on the weights only);
`--optimizer torch-default` gives both torch's AdamW with its defaults instead (a loop over the parameters on
the CPU; ~97 against ~24 ms a step for ViT-S/16's 22M parameters on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

import vitkit
from vitkit.bench import build_timm, machine_info, write_json
from vitkit.config import ViTConfig
from vitkit.cpu import autotune
from vitkit.cpu.linear import TRAINING_ENGINES, forced_training_engine, training_engine
from vitkit.timing import paired_ratio
from vitkit.train.one_step import compiled
from vitkit.train.optim import build_optimizer
from vitkit.train.settings import OptimConfig

# The optimizers both contenders may step with: vitkit's trainer's (build_optimizer), or torch's AdamW with
# its defaults over all parameters.
OPTIMIZERS = ("trainer", "torch-default")


def recipe_cell(name: str) -> tuple[ViTConfig, int, bool]:
    """The model, batch size and `compile` setting of a training recipe (vitkit.train.recipes)."""
    from vitkit.train.recipes import get_recipe

    recipe = get_recipe(name)
    return recipe.model.replace(name=f"recipe {name}"), recipe.batch_size, recipe.compile


def default_cell(name: str, batch: int) -> tuple[ViTConfig, int, bool]:
    """A preset at `batch`, with the trainer's default `compile` setting (vitkit.train.settings)."""
    from vitkit.train.settings import TrainConfig

    return vitkit.get_config(name), batch, TrainConfig().compile


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               engine: str | None = None) -> Callable[[], None]:
    """One training step of `model`; with `engine`, vitkit's linear layers compute on that engine."""
    def step() -> None:
        with forced_training_engine(engine) if engine else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()

    return step


def step_optimizer(model: nn.Module, optimizer: str = "trainer") -> torch.optim.Optimizer:
    """AdamW (lr 1e-4, weight decay 0.05) over `model`, built as `optimizer` in OPTIMIZERS says."""
    if optimizer == "trainer":
        return build_optimizer(model, OptimConfig(name="adamw", lr=1e-4, weight_decay=0.05))
    if optimizer == "torch-default":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")


def contenders(cfg: ViTConfig, batch: int, engines: Sequence[str] = (),
               optimizer: str = "trainer", compile: bool = False) -> dict[str, Callable[[], None]]:
    """The steps to time: "vitkit" (as the trainer runs it), one "vitkit[ENGINE]" per engine in `engines`,
    "timm", and with `compile` "timm-compiled" and "vitkit-compiled" (torch.compile, inductor, of the forward
    pass, as vitkit's trainer compiles); each with its own `step_optimizer(model, optimizer)`."""
    if compile:
        # Each cell compiles afresh, as a user's program would: after another cell's shapes, dynamo would
        # recompile the same forward with dynamic shapes.
        torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(batch, cfg.in_chans, *cfg.image_size)
    y = torch.randint(0, cfg.num_classes, (batch,))
    models = [("vitkit", vitkit.accelerate(vitkit.create_model(cfg)), None)]  # as vitkit's trainer runs it
    models += [(f"vitkit[{e}]", vitkit.accelerate(vitkit.create_model(cfg)), e) for e in engines]
    models.append(("timm", build_timm(cfg), None))
    if compile:
        models += [("timm-compiled", build_timm(cfg), None),
                   ("vitkit-compiled", vitkit.accelerate(vitkit.create_model(cfg)), None)]
    steps = {}
    for name, model, engine in models:
        model.train()
        opt = step_optimizer(model, optimizer)  # over the module's own parameters, compiled or not
        net = compiled(model, torch.device("cpu")) if name.endswith("-compiled") else model
        steps[name] = train_step(net, opt, x, y, engine)
    return steps


# Steps before the profiled ones. The first steps of a process grow the heap, and glibc faults each new page
# in: at ViT-S/16 batch 8 a GELU took 7-18 ms in the first two steps and 1.7 ms from the third on,
# so a profile of steps 2-3 showed costs that the timed, warmed-up steps do not have.
PROFILE_WARMUP = 4


def profile(cfg: ViTConfig, batch: int, rows: int, optimizer: str = "trainer") -> None:
    """Where the time of a training step goes, vitkit and timm, by operator (self CPU time), after
    PROFILE_WARMUP steps of each, all contenders' warm-up first as in `measure`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    steps = contenders(cfg, batch, optimizer=optimizer)
    for _ in range(PROFILE_WARMUP):
        for step in steps.values():
            step()
    for name, step in steps.items():
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
        print(f"\n=== {name}, {cfg.name or 'model'}, batch {batch}: top operators by self CPU time ===")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows,
                                        max_name_column_width=50))


def measure(cfg: ViTConfig, batch: int, repeats: int, warmup: int, seed: int, engines: Sequence[str] = (),
            optimizer: str = "trainer", compile: bool = False, trainer_compiles: bool = False) -> dict:
    """Time the contenders' steps; `trainer_compiles`: the trainer's path for this cell is the compiled one
    (needs `compile`)."""
    if trainer_compiles and not compile:
        raise ValueError("the trainer compiles this cell: time it with compile=True")
    steps = contenders(cfg, batch, engines, optimizer, compile)
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    rng = random.Random(seed)
    names = list(steps)
    for _ in range(repeats):
        rng.shuffle(names)
        for name in names:
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    main = "vitkit"
    # paired: the median over rounds of timm's step time over vitkit's in the same round (see paired_ratio)
    ratios = {name: paired_ratio(times[name], [times["timm"]]) for name in steps if name != "timm"}
    by_engine = {k: v for k, v in ratios.items() if k.startswith("vitkit[")}
    result = {
        "model": cfg.name, "batch": batch, "threads": torch.get_num_threads(), "machine": machine_info(),
        # the model's settings: a recipe's cell is named by the recipe, whose model may change
        "config": cfg.to_dict(),
        "training_engine": "per shape, timed" if autotune.enabled() else training_engine(),
        # with timing on: the engine each training product shape got in this process so far
        **({"training_products": autotune.chosen("linear-train")} if autotune.enabled() else {}),
        "optimizer": optimizer,
        "images_per_s": {name: batch / m for name, m in med.items()},
        "ratio_vitkit_over_timm": ratios[main],
        "ratio_of_medians": med["timm"] / med[main],
        **({"ratio_over_timm_by_engine": by_engine} if engines else {}),
        "seconds": times,
    }
    if compile:
        trainer = "vitkit-compiled" if trainer_compiles else main
        result.update({
            "trainer": trainer,
            "ratio_trainer_over_timm_compiled": paired_ratio(times[trainer], [times["timm-compiled"]]),
            "ratio_vitkit_compiled_over_timm_compiled": paired_ratio(times["vitkit-compiled"],
                                                                     [times["timm-compiled"]]),
        })
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--vit-batch", type=int, default=8, help="batch of the ViT-S/16 step")
    p.add_argument("--recipe", action="append", default=None,
                   help="training recipe whose model to measure (default: fashion-mnist and demo)")
    p.add_argument("--only", choices=["vit-s", "recipes"], default=None)
    p.add_argument("--engines", action="store_true",
                   help="time vitkit on each engine of its training products "
                        f"({', '.join(TRAINING_ENGINES)})")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="trainer",
                   help="both models' optimizer: vitkit's trainer's AdamW (fused where torch has it), or "
                        "torch's AdamW with its defaults")
    p.add_argument("--no-compile", action="store_true",
                   help="leave out the torch.compile contenders (timm-compiled, vitkit-compiled), which take "
                        "a minute or two to compile")
    p.add_argument("--profile", action="store_true", help="print the profiler's operator tables and exit")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cells = []
    if args.only in (None, "vit-s"):
        cells.append(default_cell("ViT-S/16", args.vit_batch))
    if args.only in (None, "recipes"):
        cells += [recipe_cell(name) for name in args.recipe or ["fashion-mnist", "demo"]]
    if args.profile:
        for cfg, batch, _ in cells:
            profile(cfg, batch, rows=18, optimizer=args.optimizer)
        return
    results = []
    for cfg, batch, trainer_compiles in cells:
        r = measure(cfg, batch, args.repeats, args.warmup, seed=0,
                    engines=TRAINING_ENGINES if args.engines else (), optimizer=args.optimizer,
                    compile=not args.no_compile, trainer_compiles=trainer_compiles and not args.no_compile)
        results.append(r)
        ips = r["images_per_s"]
        line = ", ".join(f"{name} {v:8.2f} img/s" for name, v in ips.items())
        print(f"{r['model']:>22} batch {batch:>4} threads {r['threads']}: {line}, vitkit/timm "
              f"{r['ratio_vitkit_over_timm']:.3f}x (engine {r['training_engine']}, optimizer "
              f"{args.optimizer})")
        if "trainer" in r:
            print(f"{'':>22} trainer ({r['trainer']})/timm-compiled "
                  f"{r['ratio_trainer_over_timm_compiled']:.3f}x, vitkit-compiled/timm-compiled "
                  f"{r['ratio_vitkit_compiled_over_timm_compiled']:.3f}x")
        for name, ratio in r.get("ratio_over_timm_by_engine", {}).items():
            print(f"{'':>22} {name}/timm {ratio:.3f}x")
    if args.json:
        write_json(results, args.json)


if __name__ == "__main__":
    main()
