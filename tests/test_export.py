"""ONNX export: the dynamo exporter's file, run by onnxruntime, computes PyTorch's logits (max |diff| <= 1e-4)
at any batch size, carries the preprocessing and class names, and `vitkit export` says so in one line."""

import json

import onnx
import onnxruntime as ort
import pytest
import torch

import vitkit
from vitkit.cli.main import main
from vitkit.export import INPUT_NAME, OUTPUT_NAME, check_onnx, export_onnx

CLASSES = ["cat", "dog", "bird"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model with a non-zero head, its checkpoint and its exported file (exporting takes seconds)."""
    torch.manual_seed(0)
    cfg = vitkit.ViTConfig(image_size=(16, 24), patch_size=8, dim=32, depth=2, num_heads=2, mlp_dim=64,
                           num_classes=3, in_chans=1)
    model = vitkit.create_model(cfg).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.5)
    folder = tmp_path_factory.mktemp("export")
    ckpt = vitkit.save(model, folder / "ckpt", class_names=CLASSES)
    path = export_onnx(model, folder / "model.onnx", class_names=CLASSES)
    return model, ckpt, path


def test_onnxruntime_matches_pytorch_at_any_batch(tiny):
    model, _, path = tiny
    check = check_onnx(model, path, batch_sizes=(1, 2, 5))
    assert check.ok and check.worst <= 1e-4, check.max_abs_diff
    # Written out once more by hand, so the check itself is checked.
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.randn(7, 1, 16, 24)
    (out,) = session.run([OUTPUT_NAME], {INPUT_NAME: x.numpy()})
    with torch.inference_mode():
        torch.testing.assert_close(torch.from_numpy(out), model(x), rtol=0, atol=1e-4)


def test_the_batch_axis_is_dynamic_and_named(tiny):
    _, _, path = tiny
    proto = onnx.load(str(path))
    (inp,) = proto.graph.input
    dims = inp.type.tensor_type.shape.dim
    assert inp.name == INPUT_NAME and dims[0].dim_param and not dims[0].dim_value
    assert [d.dim_value for d in dims[1:]] == [1, 16, 24]
    assert [o.name for o in proto.graph.output] == [OUTPUT_NAME]


def test_metadata_carries_preprocessing_config_and_classes(tiny):
    model, _, path = tiny
    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert json.loads(meta["vitkit.class_names"]) == CLASSES
    assert vitkit.ViTConfig.from_dict(json.loads(meta["vitkit.config"])) == model.cfg
    assert json.loads(meta["vitkit.preprocessing"])["input_size"] == [1, 16, 24]


def test_check_reports_a_mismatch(tiny):
    model, _, path = tiny
    torch.manual_seed(1)  # not the fixture's seed: other weights
    other = vitkit.create_model(model.cfg).eval()
    with torch.no_grad():
        other.head.weight.normal_(0, 0.5)
    assert not check_onnx(other, path).ok


def test_cli_exports_and_checks(tiny, tmp_path, capsys):
    _, ckpt, _ = tiny
    out = tmp_path / "sub" / "m.onnx"
    with pytest.raises(SystemExit) as e:
        main(["export", str(ckpt), str(out)])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert out.exists() and "onnxruntime matches PyTorch" in text
    # The tolerance is said as what it is: relative to logits above 1, absolute below.
    assert ("0.0001 x largest logit" in text) != ("0.0001 absolute, the largest logit" in text)


def test_cli_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", str(tmp_path / "missing"), str(tmp_path / "m.onnx")])
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err


def test_output_must_be_onnx(tiny, tmp_path):
    model, _, _ = tiny
    with pytest.raises(ValueError, match=r"\.onnx"):
        export_onnx(model, tmp_path / "model.bin")


@pytest.mark.parametrize("opset", [7, 16, 99])
def test_an_opset_the_exporter_cannot_write_is_refused_before_anything_is_written(tiny, tmp_path, opset):
    model, _, _ = tiny
    with pytest.raises(ValueError, match=f"opset {opset}: a ViT needs opset 17 or newer"):
        export_onnx(model, tmp_path / "m.onnx", opset=opset)
    assert not (tmp_path / "m.onnx").exists()


def test_the_check_scales_with_the_logits(tiny):
    from vitkit.export import ExportCheck

    assert ExportCheck({1: 5e-4}, 1e-4, max_abs_logit=10.0).ok  # 5e-5 of the largest logit
    assert not ExportCheck({1: 5e-4}, 1e-4, max_abs_logit=2.0).ok
    assert not ExportCheck({1: 2e-4}, 1e-4, max_abs_logit=0.5).ok  # absolute below 1
    model, _, path = tiny
    check = check_onnx(model, path)
    assert check.max_abs_logit > 0 and check.tolerance == 1e-4 * max(1.0, check.max_abs_logit)


def test_export_leaves_the_callers_model_as_it_was_and_refuses_an_optimized_one(tiny, tmp_path):
    model, _, path = tiny
    training = vitkit.create_model(model.cfg).train()
    export_onnx(training, tmp_path / "train.onnx")
    check_onnx(training, tmp_path / "train.onnx", batch_sizes=(1,))
    assert training.training  # exported and checked in eval mode, through a copy
    with pytest.raises(ValueError, match="export the model you passed to vitkit.optimize"):
        export_onnx(vitkit.optimize(model), tmp_path / "optimized.onnx")
    assert not (tmp_path / "optimized.onnx").exists()


@pytest.mark.parametrize("module", ["onnx", "onnxscript", "onnxruntime"])
def test_without_the_onnx_extra_the_command_names_it_in_one_line(tiny, module, monkeypatch, tmp_path, capsys):
    """Each package of the `onnx` extra missing (the exporter's two, onnxruntime for the check): one line that
    names the extra, no traceback."""
    import sys

    _, ckpt, _ = tiny
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(SystemExit) as stop:
        main(["export", str(ckpt), str(tmp_path / "m.onnx")])
    assert stop.value.code == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: vitkit export") and line.endswith("pip install 'vitkit[onnx]'")
