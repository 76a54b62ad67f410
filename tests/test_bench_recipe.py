"""benchmarks/fashion_mnist.py, the script behind the recipe records: on the tiny twin and a small stand-in
for Fashion-MNIST, its report names the split that chose best/ (the held-out part), reports the test split
once with the final weights, and records the seed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from train_helpers import fake_data_overrides, write_fake_fashion_mnist

ROOT = Path(__file__).resolve().parents[1]


def test_the_recipe_report_names_its_splits_and_seed(tmp_path):
    data = write_fake_fashion_mnist(tmp_path / "data", n_train=160, n_test=48)
    sets = [a for o in fake_data_overrides(data) + ["threads=1", "seed=2"] for a in ("--set", o)]
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fashion_mnist.py"), "--recipe",
                          "fashion-mnist-tiny", "--out", str(tmp_path / "run"), *sets],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "benchmark.json").read_text())
    assert report["seed"] == 2 and report["val_split"] == "holdout" and report["val_images"] == 32
    assert report["test_split"] == "test" and report["test_images"] == 48
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert report["test_top1"] == 100 * result["test"]["top1"]
    assert abs(report["test_top1_saved_fp32"] - report["test_top1"]) <= 100 / 48  # one image at most
    assert report["best_val_top1"] == 100 * result["val"]["best_top1"]
    assert "reached on the holdout part" in run.stdout
