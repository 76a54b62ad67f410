"""The CPU's arithmetic peak (vitkit.cpu.peak, csrc/peak.cpp) bounds what the libraries' products reach: no
fp32, bf16 or int8 product measured here runs faster than the probe of its precision, and none so much slower
that the probe must be miscounting; and benchmarks/bench_peak.py places a record's rates against the peaks."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from operator_helpers import needs_operator
from vitkit.cpu import build, peak
from vitkit.cpu.hardware import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_peak", ROOT / "benchmarks" / "bench_peak.py")
bench_peak = importlib.util.module_from_spec(spec)
sys.modules["bench_peak"] = bench_peak
spec.loader.exec_module(bench_peak)

ZEN4 = {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"}
needs_probe = needs_operator(lambda: build.kernels_enabled() and build._peak_built(), "peak probe")


def test_probes_follow_the_cpu_flags():
    assert peak.best_kinds(ZEN4) == {"fp32": "fp32-avx512", "bf16": "bf16-avx512", "int8": "int8-avx512"}
    # AVX2 only (a Zen 3): no native bf16, int8 by the three-instruction sequence
    assert peak.best_kinds({"avx2", "fma"}) == {"fp32": "fp32-avx2", "int8": "int8-avx2"}
    assert peak.best_kinds({"avx2", "fma", "avx_vnni"})["int8"] == "int8-avxvnni"
    # held to AVX2 on an AVX-512 CPU, as the proxy runs are
    assert peak.best_kinds(ZEN4, isa="avx2") == {"fp32": "fp32-avx2", "int8": "int8-avx2"}
    assert peak.kinds_here({"sse4_2"}) == []
    with pytest.raises(ValueError, match="isa='sse'"):
        peak.kinds_here(ZEN4, isa="sse")


def test_probe_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="unknown probe 'fp64-avx512'"):
        peak.peak_rate("fp64-avx512")
    missing = [k for k in peak.PROBES if k not in peak.kinds_here()]
    if not missing:
        pytest.skip("this CPU has every probed instruction")
    with pytest.raises(ValueError, match=f"this CPU lacks .* for probe '{missing[0]}'"):
        peak.peak_rate(missing[0])


@needs_probe
def test_probe_counts_its_ops():
    kind = peak.best_kinds()["fp32"]
    lanes = 16 if kind == "fp32-avx512" else 8
    assert torch.ops.vitkit.peak_ops(kind, 1000) == 12 * lanes * 2 * 1000 * torch.get_num_threads()
    with pytest.raises(RuntimeError, match="iterations must be positive"):
        torch.ops.vitkit.peak_ops(kind, 0)
    with pytest.raises(RuntimeError, match="unknown kind 'nope'"):
        torch.ops.vitkit.peak_ops("nope", 10)


@needs_probe
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_no_product_beats_the_peak(precision, threads):
    threads(1)
    kinds = peak.best_kinds()
    if precision not in kinds:
        pytest.skip(f"no native {precision} here")
    if "amx_tile" in cpu_flags() and precision != "fp32":
        pytest.skip("oneDNN's bf16 and int8 products run on AMX here, which the probe does not measure")
    m, k, n = 256, 1024, 1024  # a product as optimize's layers compute it
    with torch.no_grad():
        rate = 2.0 * m * k * n / bench_peak.best_seconds(bench_peak.layer_call(precision, m, k, n), 20, 5)
    top = peak.peak_rate(kinds[precision], seconds=0.1, repeats=5)
    assert rate <= 1.05 * top, (
        f"{precision}: a product at {rate / 1e9:.0f} GOP/s beats the peak {top / 1e9:.0f}: the probe counts "
        "too little")
    # int8 products quantise their input and reach half to three quarters of the VNNI peak; fp32 and bf16
    # ones most of theirs
    assert rate >= (0.15 if precision == "int8" else 0.3) * top, (
        f"{precision}: {rate / 1e9:.0f} GOP/s against a peak of {top / 1e9:.0f}: the probe counts too much")


def test_bench_peak_places_records_against_the_peaks():
    peaks = {"fp32": {"kind": "fp32-avx512", "gops": 200.0}, "int8": {"kind": "int8-avx512", "gops": 800.0}}
    rows = [
        {"record": "r1", "model": "ViT-S/16", "batch": 1, "contender": "vitkit-fp32-opt", "gflops": 150.0,
         "vs_best_runtime": 0.75},
        {"record": "r1", "model": "ViT-S/16", "batch": 1, "contender": "openvino-fp32", "gflops": 200.0,
         "vs_best_runtime": None},
        {"record": "r1", "model": "ViT-S/16", "batch": 1, "contender": "vitkit-int8", "gflops": 400.0,
         "vs_best_runtime": 1.0},
        {"record": "r1", "model": "ViT-S/16", "batch": 1, "contender": "openvino-bf16", "gflops": 300.0,
         "vs_best_runtime": None},  # no bf16 peak given: left out
    ]
    cells = {r["contender"]: r for r in bench_peak.of_peak(rows, peaks)}
    assert set(cells) == {"vitkit-fp32-opt", "openvino-fp32", "vitkit-int8"}
    assert cells["vitkit-fp32-opt"]["of_peak"] == pytest.approx(0.75)
    # the faster runtime ran at 150 / 0.75 = 200 GFLOP/s; 1.05x that is 210, of a 200 peak
    assert cells["vitkit-fp32-opt"]["target_of_peak"] == pytest.approx(1.05)
    assert cells["vitkit-int8"]["target_of_peak"] == pytest.approx(0.55)
    assert "target_of_peak" not in cells["openvino-fp32"]
    assert cells["vitkit-int8"]["precision"] == "int8"


def test_bench_peak_refuses_a_record_without_runtimes(tmp_path):
    path = tmp_path / "infer-b1.json"
    path.write_text('{"rows": [{"contender": "vitkit", "vs_best_runtime": null}]}')
    with pytest.raises(SystemExit, match="not a `vitkit bench --runtimes` record"):
        bench_peak.read_rows([path])
    with pytest.raises(SystemExit, match="missing.json"):
        bench_peak.read_rows([tmp_path / "missing.json"])
