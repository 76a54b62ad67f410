"""What the core install does without its extras (vitkit.extras): a feature that needs one names the extra in
one line; a training run goes on without its side outputs and says what it skipped. A package counts as
missing here when its sys.modules entry is None, as import then fails."""

from __future__ import annotations

import sys

import pytest
import torch

import vitkit
from operator_helpers import warnings_of_two_builds
from train_helpers import synthetic_dataset
from vitkit.cli.main import main
from vitkit.extras import MissingExtra, available, require
from vitkit.train import get_recipe, train


def missing(monkeypatch, *modules: str) -> None:
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_require_names_the_extra_and_available_tells(monkeypatch):
    assert available("sklearn") and require("sklearn", "the linear probe") is sys.modules["sklearn"]
    missing(monkeypatch, "sklearn")
    assert not available("sklearn")
    with pytest.raises(MissingExtra, match=r"^the linear probe needs scikit-learn: pip install 'vitkit\[skl"):
        require("sklearn", "the linear probe")
    from vitkit.analysis.probe import linear_probe

    x, y = torch.randn(20, 4), torch.arange(20) % 2
    with pytest.raises(MissingExtra, match="vitkit\\[sklearn\\]"):
        linear_probe(x, y, x, y)


def test_a_figure_command_without_matplotlib_is_one_error_line(monkeypatch, tmp_path, capsys):
    vitkit.save(vitkit.create_model("ViT-Ti/16", num_classes=3, image_size=32, patch_size=8, depth=1),
                tmp_path / "m")
    missing(monkeypatch, "matplotlib", "matplotlib.pyplot", "matplotlib.figure")
    monkeypatch.delitem(sys.modules, "vitkit.analysis.figures", raising=False)  # imported again, and fails
    with pytest.raises(SystemExit) as stop:
        main(["analyze", "filters", str(tmp_path / "m"), "--out", str(tmp_path / "f.png")])
    assert stop.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: vitkit's figures needs matplotlib: pip install 'vitkit[figures]' (or vitkit[all])"]
    assert not (tmp_path / "f.png").exists()


def test_training_without_matplotlib_and_tensorboard_keeps_its_results_and_says_what_it_skipped(
        monkeypatch, tmp_path):
    missing(monkeypatch, "matplotlib", "tensorboard")
    cfg = get_recipe("demo-tiny", ["threads=1", "steps=2", "eval_every=2", "ckpt_every=2"])
    with pytest.warns(RuntimeWarning) as said:
        train(cfg, tmp_path / "run", train_set=synthetic_dataset(32, seed=0),
              val_set=synthetic_dataset(16, seed=1), progress=False)
    messages = " | ".join(str(w.message) for w in said)
    assert "vitkit[tensorboard]" in messages and "confusion.png not drawn" in messages
    assert "vitkit[figures]" in messages
    assert (tmp_path / "run" / "result.json").is_file() and (tmp_path / "run" / "metrics.csv").is_file()
    assert (tmp_path / "run" / "last" / "model.safetensors").is_file()
    assert not (tmp_path / "run" / "confusion.png").exists() and not (tmp_path / "run" / "tb").exists()


def test_without_ninja_the_operators_say_which_extra_once(monkeypatch):
    from vitkit.cpu import build

    monkeypatch.setattr(build, "cxx_compiler", lambda: "/usr/bin/c++")
    monkeypatch.setattr(build, "available", lambda module: False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.setattr(build, "_build", lambda *a, **k: pytest.fail("a build was attempted"))
    build.no_build_tool.cache_clear()
    said = warnings_of_two_builds()
    assert len(said) == 1 and "pip install 'vitkit[kernels]'" in said[0]
    build.no_build_tool.cache_clear()


def test_the_hint_offers_vitkit_all_only_for_the_extras_it_brings():
    """IN_ALL is pyproject.toml's `all`; an extra outside it (OpenVINO, the benchmarks' runtimes) is named
    alone, and a package of two extras can be named by the feature's own."""
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path

    from vitkit.extras import IN_ALL, pip_command

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    (all_,) = project["optional-dependencies"]["all"]
    assert all_ == f"vitkit[{','.join(IN_ALL)}]"
    assert pip_command("sklearn") == "pip install 'vitkit[sklearn]' (or vitkit[all])"
    assert pip_command("openvino") == "pip install 'vitkit[bench-runtimes]'"
    assert pip_command("openvino", "openvino") == "pip install 'vitkit[openvino]'"
    assert "openvino>=2024.0" in project["optional-dependencies"]["openvino"]
