"""benchmarks/bench_training.py's torch.compile contenders, run for real on a small model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import vitkit
from vitkit import bench

ROOT = Path(__file__).resolve().parents[1]


def load_bench_training():
    spec = importlib.util.spec_from_file_location("bench_training", ROOT / "benchmarks" / "bench_training.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_benchmark_times_timm_compiled_and_the_trainers_path():
    """With compile on, timm through torch.compile and vitkit's compiled path join the eager contenders, and
    the headline against timm compiled is the path the trainer takes for the cell (compiled where the recipe
    compiles, eager where it does not)."""
    script = load_bench_training()
    cfg = vitkit.get_config("ViT-Ti/16").replace(image_size=(32, 32), patch_size=8, depth=1, num_classes=5)
    r = script.measure(cfg, batch=2, repeats=2, warmup=1, seed=0, compile=True, trainer_compiles=True)
    assert set(r["images_per_s"]) == {"vitkit", "timm", "timm-compiled", "vitkit-compiled"}
    seconds = r["seconds"]
    assert all(len(t) == 2 and min(t) > 0 for t in seconds.values())
    assert r["trainer"] == "vitkit-compiled"
    assert r["ratio_trainer_over_timm_compiled"] == bench.paired_ratio(seconds["vitkit-compiled"],
                                                                      [seconds["timm-compiled"]])
    eager = script.measure(cfg, batch=2, repeats=1, warmup=0, seed=0)
    assert set(eager["images_per_s"]) == {"vitkit", "timm"} and "trainer" not in eager
    with pytest.raises(ValueError, match="compile=True"):
        script.measure(cfg, batch=2, repeats=1, warmup=0, seed=0, trainer_compiles=True)
    # the cells know the trainer's choice: the fashion-mnist recipe compiles, a preset by default does not
    assert script.recipe_cell("fashion-mnist")[2] is True
    assert script.default_cell("ViT-S/16", 8)[2] is False


def test_compiled_contenders_train_the_model():
    """A compiled contender's step changes its model's weights as the eager step does (the optimizer holds
    the module's own parameters, not a copy)."""
    import torch

    script = load_bench_training()
    cfg = vitkit.get_config("ViT-Ti/16").replace(image_size=(32, 32), patch_size=8, depth=1, num_classes=5)
    torch.manual_seed(0)
    model = script.build_timm(cfg).train()
    before = [p.detach().clone() for p in model.parameters()]
    opt = script.step_optimizer(model)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 3])
    script.train_step(script.compiled(model, torch.device("cpu")), opt, x, y)()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
               if b.requires_grad)
