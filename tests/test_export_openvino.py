"""OpenVINO IR export: `vitkit export CKPT OUT --to openvino` writes OUT.xml + OUT.bin (fp32 weights) whose
logits under OpenVINO's CPU runtime at fp32 are PyTorch's (max |diff| <= 1e-4 of the largest logit) at any
batch size, with the ONNX file's names, dynamic batch axis and metadata; a format that does not match the
file's suffix, and a missing OpenVINO, are one line each.

OpenVINO runs only in processes of its own (tests/process_helpers.py): its thread pools, loaded in the test
process beside inductor, crashed a later fork of it. The tests that need no OpenVINO run here."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from process_helpers import in_child
from vitkit.cli.main import main
from vitkit.cli.speed import export_target
from vitkit.export import INPUT_NAME, OPENVINO_FP32, OUTPUT_NAME, check_openvino, export_openvino
from vitkit.extras import MissingExtra, available

CLASSES = ["cat", "dog", "bird"]
BATCHES = (1, 3, 5)


def tiny_model(seed: int, cfg: vitkit.ViTConfig | None = None) -> torch.nn.Module:
    """test_export.py's tiny model, with a head of logits well above 1."""
    torch.manual_seed(seed)
    cfg = cfg or vitkit.ViTConfig(image_size=(16, 24), patch_size=8, dim=32, depth=2, num_heads=2, mlp_dim=64,
                                  num_classes=3, in_chans=1)
    model = vitkit.create_model(cfg).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.5)
    return model


def export_and_run(folder: str) -> None:
    """In a child process: `vitkit export ckpt m --to openvino` (its output into stdout.txt, its exit code
    into facts.json), then the IR m.xml under OpenVINO at fp32 on inputs.npz, into outputs.npz; what the IR
    says about itself, and the API's check of it against the checkpoint's model and against other weights,
    into facts.json."""
    import openvino as ov

    here = Path(folder)
    said = io.StringIO()
    with contextlib.redirect_stdout(said), pytest.raises(SystemExit) as stop:
        main(["export", str(here / "ckpt"), str(here / "m"), "--to", "openvino"])
    (here / "stdout.txt").write_text(said.getvalue())
    assert stop.value.code == 0, said.getvalue()
    core = ov.Core()
    graph = core.read_model(str(here / "m.xml"))
    compiled = core.compile_model(graph, "CPU", OPENVINO_FP32)
    inputs = np.load(here / "inputs.npz")
    np.savez(here / "outputs.npz", **{k: compiled({INPUT_NAME: inputs[k]})[compiled.output(OUTPUT_NAME)]
                                      for k in inputs.files})
    model = vitkit.load(here / "ckpt")
    check, other = (check_openvino(m, here / "m.xml") for m in (model, tiny_model(1, model.cfg)))
    facts = {
        "inputs": [sorted(p.get_names()) for p in graph.inputs],
        "outputs": [sorted(p.get_names()) for p in graph.outputs],
        "input_shape": [str(d) for d in graph.input(INPUT_NAME).get_partial_shape()],
        "metadata": {k: graph.get_rt_info(["vitkit", k]).astype(str)
                     for k in ("preprocessing", "config", "class_names")},
        "constant_types": sorted({op.get_element_type().get_type_name() for op in graph.get_ops()
                                  if op.get_type_name() == "Constant"}),
        "check": {"ok": check.ok, "diffs": list(check.max_abs_diff.items()), "largest": check.max_abs_logit},
        "other_ok": other.ok,
    }
    (here / "facts.json").write_text(json.dumps(facts))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The tiny model's checkpoint exported by the command line (OUT without a suffix, --to openvino) and run
    by OpenVINO, in a process of their own (`export_and_run`): model, folder, the command's stdout, facts."""
    if not (available("openvino") and available("onnxscript")):
        pytest.skip("OpenVINO is not installed (pip install 'vitkit[openvino]')")
    model = tiny_model(0)
    folder = tmp_path_factory.mktemp("openvino")
    vitkit.save(model, folder / "ckpt", class_names=CLASSES)
    gen = torch.Generator().manual_seed(2)
    inputs = {str(b): torch.randn(b, 1, 16, 24, generator=gen).numpy() for b in BATCHES}
    np.savez(folder / "inputs.npz", **inputs)
    in_child(__file__, f"export_and_run({str(folder)!r})")
    return model, folder, (folder / "stdout.txt").read_text(), json.loads((folder / "facts.json").read_text())


def test_the_command_writes_xml_and_bin_and_checks_them(exported):
    _, folder, stdout, _ = exported
    assert (folder / "m.xml").is_file() and (folder / "m.bin").is_file()
    assert f"wrote {folder / 'm.xml'} + {folder / 'm.bin'}" in stdout
    assert "OpenVINO (CPU, f32) matches PyTorch: max |diff| batch 1: " in stdout and "batch 3: " in stdout


def test_openvino_computes_pytorchs_logits_at_any_batch(exported):
    """Written out here, against PyTorch in this process, so that the check itself is checked."""
    model, folder, _, facts = exported
    inputs, outputs = np.load(folder / "inputs.npz"), np.load(folder / "outputs.npz")
    for b in BATCHES:
        with torch.inference_mode():
            ref = model(torch.from_numpy(inputs[str(b)]))
        largest = ref.abs().max().item()
        assert largest > 1  # a head of real logits, not zeros
        torch.testing.assert_close(torch.from_numpy(outputs[str(b)]), ref, rtol=0, atol=1e-4 * largest)
    check = facts["check"]
    assert check["ok"] and [b for b, _ in check["diffs"]] == [1, 3]
    assert all(d <= 1e-4 * check["largest"] for _, d in check["diffs"])
    assert not facts["other_ok"]  # other weights: the check fails


def test_names_dynamic_batch_and_fp32_weights(exported):
    _, _, _, facts = exported
    assert facts["inputs"] == [[INPUT_NAME]] and facts["outputs"] == [[OUTPUT_NAME]]
    assert facts["input_shape"] == ["?", "1", "16", "24"]
    assert "f32" in facts["constant_types"] and "f16" not in facts["constant_types"]


def test_metadata_carries_preprocessing_config_and_classes(exported):
    model, _, _, facts = exported
    meta = {k: json.loads(v) for k, v in facts["metadata"].items()}
    assert meta["class_names"] == CLASSES
    assert vitkit.ViTConfig.from_dict(meta["config"]) == model.cfg
    assert meta["preprocessing"]["input_size"] == [1, 16, 24]


@pytest.mark.parametrize("to, output, expected", [
    (None, "m.onnx", ("onnx", "m.onnx")), (None, "m.xml", ("openvino", "m.xml")),
    (None, "m", ("onnx", "m.onnx")), ("openvino", "out/m", ("openvino", "out/m.xml")),
    ("onnx", "m.onnx", ("onnx", "m.onnx")),
])
def test_the_format_comes_from_to_or_the_suffix(to, output, expected):
    fmt, path = export_target(to, Path(output))
    assert (fmt, path) == (expected[0], Path(expected[1]))


@pytest.mark.parametrize("args, said", [
    (["m.onnx", "--to", "openvino"],
     "--to openvino does not match m.onnx: OpenVINO IR files end in .xml, .onnx is ONNX (--to onnx)"),
    (["m.xml", "--to", "onnx"],
     "--to onnx does not match m.xml: ONNX files end in .onnx, .xml is OpenVINO IR (--to openvino)"),
    (["m.bin"], "m.bin: an export ends in .onnx (ONNX) or .xml (OpenVINO IR)"),
    (["m.xml", "--opset", "18"], "--opset is for ONNX files, not OpenVINO IR"),
])
def test_a_format_that_does_not_match_the_suffix_is_one_line(tmp_path, capsys, args, said):
    """Refused before the checkpoint is read (there is none here) and before anything is written."""
    with pytest.raises(SystemExit) as stop:
        main(["export", str(tmp_path / "missing"), *(str(tmp_path / args[0]), *args[1:])])
    assert stop.value.code == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {said}"]
    assert not any(tmp_path.iterdir())


def test_without_openvino_the_command_names_the_extra_in_one_line(monkeypatch, tmp_path, capsys):
    vitkit.save(tiny_model(0), tmp_path / "ckpt")
    monkeypatch.setitem(sys.modules, "openvino", None)  # as if not installed
    with pytest.raises(SystemExit) as stop:
        main(["export", str(tmp_path / "ckpt"), str(tmp_path / "m.xml")])
    assert stop.value.code == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: vitkit export --to openvino needs openvino: pip install 'vitkit[openvino]'"]
    assert not (tmp_path / "m.xml").exists()
    with pytest.raises(MissingExtra, match=r"pip install 'vitkit\[openvino\]'$"):
        check_openvino(tiny_model(0), tmp_path / "m.xml")


def test_the_api_wants_an_xml_path(tmp_path):
    with pytest.raises(ValueError, match=r"should end in \.xml"):
        export_openvino(tiny_model(0), tmp_path / "m.onnx")
