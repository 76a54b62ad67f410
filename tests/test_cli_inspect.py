"""`vitkit --help`, `vitkit models` and `vitkit info`, run through vitkit.cli.main.main so that its error
handling (one line + a hint, non-zero exit, no traceback) is what is tested."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vitkit
from vitkit import ViTConfig, count_parameters
from vitkit.checkpoint import WEIGHTS_NAME
from vitkit.cli.main import main
from vitkit.config import PRESETS, get_preset
from vitkit.model import VisionTransformer


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `vitkit ARGV`."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    captured = capsys.readouterr()
    return exit_info.value.code or 0, captured.out, captured.err


def assert_one_line_error(code: int, out: str, err: str, *fragments: str) -> None:
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("error: ") and lines[1].startswith("hint: ")
    for fragment in fragments:
        assert fragment in lines[0]
    assert "Traceback" not in out + err


@pytest.fixture()
def checkpoint(tmp_path):
    cfg = ViTConfig(image_size=32, patch_size=8, dim=32, depth=2, num_heads=4, mlp_dim=64, num_classes=3,
                    pos_embed="learned-2d", name="tiny-test")
    return vitkit.save(VisionTransformer(cfg), tmp_path / "ckpt", class_names=["cat", "dog", "emu"])


# --- help ---------------------------------------------------------------------------------------------
def test_help_lists_the_commands(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    assert "Usage: vitkit" in out and "models" in out and "info" in out


@pytest.mark.parametrize("command", ["models", "info"])
def test_every_command_has_help(capsys, command):
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    assert f"Usage: vitkit {command}" in out


@pytest.mark.parametrize(("argv", "sentence"), [
    (["train", "--help"],
     "With --nproc N, or under torchrun --nproc_per_node N -m vitkit.cli.main train ..., the "
     "same command runs data-parallel (gloo on CPUs, nccl on GPUs)."),
    (["analyze", "attention", "--help"],
     "By default, attention rollout: the heads' mean plus the identity (the "
     "residual path), rows re-normalised, multiplied through all layers."),
])
def test_help_paragraphs_are_reflowed_not_broken_where_the_source_breaks(capsys, monkeypatch, argv, sentence):
    """Docstrings wrap at 120 columns in the source; on a wide terminal each paragraph is one line."""
    monkeypatch.setenv("COLUMNS", "300")
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert any(sentence in line for line in out.splitlines()), out


def test_the_listing_shows_the_train_summary_on_one_line(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    code, out, _ = run(capsys, "--help")
    assert code == 0
    assert any("train" in line and "Train a ViT with a recipe, on one process or data-parallel." in line
               for line in out.splitlines()), out


def test_the_installed_console_script_runs():
    script = Path(sys.executable).parent / "vitkit"
    try:
        importlib.metadata.distribution("vitkit")
    except importlib.metadata.PackageNotFoundError:
        # e.g. a GPU machine running the tests with PYTHONPATH=src
        pytest.skip("vitkit is imported from a source tree, not installed: there is no console script")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "models" in result.stdout


# --- models -------------------------------------------------------------------------------------------
def table_rows(out: str) -> dict[str, list[str]]:
    """The table's body rows by preset name, cells stripped."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 7 and cells[0] in PRESETS:
            rows[cells[0]] = cells
    return rows


def test_models_lists_every_preset_with_its_counts(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0
    rows = table_rows(out)
    assert list(rows) == list(PRESETS)  # every preset, the hybrids included, in order
    assert rows["ViT-B/16"] == ["ViT-B/16", "vit_base_patch16_224", "224x224", "86,567,656", "35.13", "17.56",
                                 "197"]
    assert rows["ViT-Ti/16"][3] == "5,717,416"
    assert rows["ViT-S/16"][3] == "22,050,664"
    assert rows["ViT-L/16"][3] == "304,326,632"
    assert rows["ViT-H/14"][3] == "632,045,800"
    assert rows["ViT-H/14@518"][-1] == str(37 * 37 + 1)
    hybrid = PRESETS["R50+ViT-B/16"].config
    assert rows["R50+ViT-B/16"][3] == f"{count_parameters(hybrid):,}"


def test_models_filter_and_head_size(capsys):
    code, out, _ = run(capsys, "models", "H/14", "--classes", "0")
    assert code == 0
    rows = table_rows(out)
    assert list(rows) == ["ViT-H/14", "ViT-H/14@518"]
    assert rows["ViT-H/14"][3] == "630,764,800"  # the count without the head
    _, out, _ = run(capsys, "models", "vit_small_patch16")
    assert list(table_rows(out)) == ["ViT-S/16", "ViT-S/16@384"]


def test_models_with_a_filter_that_matches_nothing_says_so(capsys):
    code, out, err = run(capsys, "models", "nothing-like-this")
    assert code == 1 and table_rows(out) == {} and "no preset matches 'nothing-like-this'" in err


def test_models_filter_takes_any_name_the_presets_answer_to(capsys):
    # "R50+B/16" is no substring of "R50+ViT-B/16", but get_preset knows it, as create_model does.
    for name in ("R50+B/16", "r26+vit-s/32@384", "vit_base_patch16_224.augreg2_in21k_ft_in1k"):
        code, out, _ = run(capsys, "models", name)
        assert code == 0, name
        assert get_preset(name).name in table_rows(out), name


def test_models_rejects_a_bad_option_without_a_traceback(capsys):
    code, out, err = run(capsys, "models", "--classes", "many")
    assert code == 2 and "Traceback" not in out + err and "Invalid value for '--classes'" in err


# --- info ---------------------------------------------------------------------------------------------
def test_info_describes_a_checkpoint(capsys, checkpoint):
    code, out, _ = run(capsys, "info", str(checkpoint))
    assert code == 0
    n_params = sum(p.numel() for p in vitkit.load(checkpoint).parameters())
    for fragment in ("tiny-test", "32x32, 3 channel(s)", "grid 4x4, 17 tokens", "32 / 2 / 4 / 64",
                     "token / learned-2d", "exact / 1e-06", f"{n_params:,}", "3: cat, dog, emu", "crop_pct"):
        assert fragment in out, fragment
    from vitkit import count_flops

    flops = count_flops(vitkit.load(checkpoint).cfg) / 1e9
    assert flops < 0.005 and f"{flops:.3g}" in out  # a small model's GFLOPs are not shown as 0.00


def test_info_says_how_a_model_differs_from_the_preset_it_is_named_after(capsys, tmp_path):
    vitkit.save(vitkit.create_model("ViT-Ti/16", num_classes=3, image_size=32, depth=2), tmp_path / "ck")
    code, out, _ = run(capsys, "info", str(tmp_path / "ck"))
    assert code == 0
    assert "vit_tiny_patch16_224 (the preset with image_size=(32, 32), depth=2)" in " ".join(out.split())


def test_info_on_a_config_with_a_wrong_type_names_the_field(capsys, checkpoint, tmp_path):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    meta = json.loads((bad / "config.json").read_text())
    meta["model"]["depth"] = float(meta["model"]["depth"])  # 2.0: a hand edit
    (bad / "config.json").write_text(json.dumps(meta))
    code, out, err = run(capsys, "info", str(bad))
    assert code == 1 and "Traceback" not in out + err
    assert f"depth={meta['model']['depth']} must be an integer" in err and "config.json" in err


def test_info_on_a_missing_path_is_one_line_and_a_hint(capsys):
    code, out, err = run(capsys, "info", "/not/there")
    assert_one_line_error(code, out, err, "/not/there: no such file or folder")


def test_info_on_a_folder_that_is_not_a_checkpoint(capsys, tmp_path):
    code, out, err = run(capsys, "info", str(tmp_path))
    assert_one_line_error(code, out, err, str(tmp_path), "not a vitkit checkpoint")


def test_info_on_a_truncated_checkpoint(capsys, checkpoint):
    weights = checkpoint / WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[:1000])
    code, out, err = run(capsys, "info", str(checkpoint))
    assert_one_line_error(code, out, err, str(weights), "not a readable safetensors file")


def test_info_on_tensors_that_do_not_fit(capsys, checkpoint):
    from safetensors.torch import load_file, save_file

    state = load_file(str(checkpoint / WEIGHTS_NAME))
    state["head.weight"] = torch.zeros(4, 32)
    save_file(state, str(checkpoint / WEIGHTS_NAME))
    code, out, err = run(capsys, "info", str(checkpoint))
    assert_one_line_error(code, out, err, "head.weight: file (4, 32) vs model (3, 32)")


def test_info_without_a_path_is_a_usage_error(capsys):
    code, out, err = run(capsys, "info")
    assert code == 2 and "Traceback" not in out + err and "Missing argument" in err


def test_unknown_command_is_a_usage_error(capsys):
    code, out, err = run(capsys, "trian")
    assert code == 2 and "Traceback" not in out + err
