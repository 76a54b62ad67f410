"""The runtimes `vitkit bench --runtimes` times vitkit against (ONNX Runtime, OpenVINO, timm through
torch.compile): each computes the same function as the vitkit model it starts from, and the harness pairs
vitkit's optimized models with the faster runtime at their precision.

Each check runs in a process of its own (tests/process_helpers.py): OpenVINO's thread pools and inductor's
`freezing` setting are process-wide, and a later fork of the test process (a subprocess test) crashed with
them."""

from __future__ import annotations

import json

import pytest
import torch

import vitkit
from process_helpers import in_child
from vitkit import bench, timing
from vitkit.bench_runtimes import RUNTIMES, available, build_openvino, build_ort
from vitkit.extras import MissingExtra

TINY = vitkit.ViTConfig(image_size=32, patch_size=8, dim=32, depth=2, num_heads=2, mlp_dim=64, num_classes=10)


def plain_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return bench.build_vitkit(TINY, fast=False).eval()


def needs(name: str) -> None:
    if not available(name):
        pytest.skip(f"{name}: its runtime is not installed (pip install 'vitkit[bench-runtimes]') or the CPU "
                    "lacks native bf16")


def check_runtime(name, atol):
    """The exported model's logits at two batch sizes (one compilation each), within fp32's rounding for the
    fp32 runtimes and within the quantisation's error (logits of about 1) for int8 and bf16."""
    model = plain_model()
    runtime = (build_ort if name.startswith("ort") else build_openvino)(model, name.split("-")[1])
    for batch in (1, 3):
        x = torch.randn(batch, 3, 32, 32)
        with torch.no_grad():
            expected = model(x)
        got = runtime(x)
        assert got.shape == (batch, 10) and got.dtype == torch.float32
        assert (got - expected).abs().max().item() <= atol * max(1.0, expected.abs().max().item()), name
    assert len(runtime.compiled) == 2


def test_a_missing_runtime_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "openvino", None)  # as if not installed
    assert not available("openvino-fp32")
    with pytest.raises(MissingExtra, match=r"pip install 'vitkit\[bench-runtimes\]'"):
        build_openvino(plain_model(), "fp32")


def check_harness():
    """A tiny end-to-end run with the fp32 runtimes (and int8 where installed): vitkit-fp32-opt's row carries
    its paired ratio to the faster of them, a runtime's row none."""
    fp32 = [r for r in ("ort-fp32", "openvino-fp32") if available(r)]
    config = bench.BenchConfig(models=(TINY,), batch_sizes=(2,), repeats=2, warmup=1, sgemm_size=128,
                               threads=1, contenders=("vitkit-fp32-opt", "timm", *fp32))
    rows = {r["contender"]: r for r in bench.run(config)["rows"]}
    times = [rows[r]["seconds"] for r in fp32]
    assert rows["vitkit-fp32-opt"]["vs_best_runtime"] == pytest.approx(
        timing.paired_ratio(rows["vitkit-fp32-opt"]["seconds"], times))
    assert all(rows[r]["vs_best_runtime"] is None for r in fp32)
    assert set(RUNTIMES) <= set(bench.BUILDERS) and "timm-compiled" in bench.BUILDERS


def check_timm_compiled():
    """torch.compile (inductor, freezing) of timm's model computes what timm's eager model does."""
    torch.manual_seed(0)
    eager = bench.build_timm(TINY).eval()
    torch.manual_seed(0)
    compiled = bench.build_timm_compiled(TINY)
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), eager(x), atol=1e-5, rtol=1e-5)


TOLERANCES = {"ort-fp32": 1e-4, "openvino-fp32": 1e-4, "ort-int8": 0.1, "openvino-int8": 0.1,
              "openvino-bf16": 0.1}
RESULTS = "runtime checks: "


def check_runtimes(names):
    """check_runtime for each name in one process (the runtimes' process-wide state is theirs to share);
    prints each one's failure, or None, as one JSON line."""
    failures = {}
    for name in names:
        try:
            check_runtime(name, TOLERANCES[name])
            failures[name] = None
        except Exception as e:  # noqa: BLE001 - reported to the test of that name
            failures[name] = f"{type(e).__name__}: {e}"
    print(RESULTS + json.dumps(failures))


@pytest.fixture(scope="module")
def runtime_failures():
    """Every installed runtime's check, run once in a child process of its own (a process start and the
    runtimes' imports each, rather than one per runtime)."""
    names = [name for name in TOLERANCES if available(name)]
    out = in_child(__file__, f"check_runtimes({names!r})")
    return json.loads(next(line for line in out.splitlines() if line.startswith(RESULTS))[len(RESULTS):])


@pytest.mark.parametrize("name", list(TOLERANCES))
def test_each_runtime_computes_the_vitkit_models_function(name, request):
    """The exported model's logits at two batch sizes (one compilation each), within fp32's rounding for the
    fp32 runtimes and within the quantisation's error (logits of about 1) for int8 and bf16."""
    needs(name)
    failures = request.getfixturevalue("runtime_failures")
    assert failures[name] is None, failures[name]


def test_the_harness_pairs_vitkit_with_the_faster_runtime_at_its_precision():
    """A tiny end-to-end run with the fp32 runtimes: vitkit-fp32-opt's row carries its paired ratio to the
    faster of them, a runtime's row none."""
    if not any(available(r) for r in ("ort-fp32", "openvino-fp32")):
        pytest.skip("no inference runtime installed (pip install 'vitkit[bench-runtimes]')")
    in_child(__file__, "check_harness()")


def test_timm_compiled_is_timms_function():
    """torch.compile (inductor, freezing) of timm's model computes what timm's eager model does."""
    in_child(__file__, "check_timm_compiled()")


def test_calibration_batches_take_the_given_images_in_batches_of_the_shape():
    """OpenVINO's int8 calibration: consecutive full batches of the given images (a short last one dropped),
    about `size` images in all; random ones of the shape, seeded, without images; too few images for one
    batch is an error naming both counts."""
    from vitkit.bench_runtimes import calibration_batches

    images = torch.arange(10 * 3 * 2 * 2, dtype=torch.float32).reshape(10, 3, 2, 2)
    batches = calibration_batches((4, 3, 2, 2), 8, images)
    assert len(batches) == 2 and all(b.shape == (4, 3, 2, 2) for b in batches)
    assert (batches[1] == images[4:8].numpy()).all()
    assert len(calibration_batches((4, 3, 2, 2), 100, images)) == 2  # 10 images: two full batches
    random = calibration_batches((2, 3, 2, 2), 6)
    assert len(random) == 3 and (random[0] == calibration_batches((2, 3, 2, 2), 6)[0]).all()
    with pytest.raises(ValueError, match="3 calibration images make no batch of 4"):
        calibration_batches((4, 3, 2, 2), 8, images[:3])
