"""vitkit's fp32 product operator for AVX2 CPUs (csrc/gemm.cpp) against F.linear, and PackedLinear on it.

`vitkit.optimize` offers the operator only on CPUs with AVX2 but not AVX-512; it runs on any x86 CPU with AVX2
and FMA, so these tests build and run it on all of them (skipped elsewhere, or where operators cannot be
built: tests/operator_helpers.py)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from operator_helpers import needs_operator
from vitkit.cpu import build, packed
from vitkit.cpu.hardware import cpu_flags
from vitkit.cpu.packed import PackedLinear


def gemm_built() -> bool:
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("the fp32 product operator needs a CPU with AVX2 and FMA")
    return build.kernels_enabled() and build._gemm_built()


needs_gemm = needs_operator(gemm_built, "fp32 product")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4 * max(1.0, b.abs().max().item()))


@needs_gemm
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 197])
@pytest.mark.parametrize("inner,outer", [(3, 16), (100, 48), (384, 384), (800, 80), (768, 2304)])
def test_the_product_is_f_linear(rows, inner, outer, threads):
    g = torch.Generator().manual_seed(rows * 1000 + inner + outer)
    x, w, b = (torch.randn(*s, generator=g) for s in ((rows, inner), (outer, inner), (outer,)))
    p = torch.ops.vitkit.gemm_pack(w)
    close(torch.ops.vitkit.gemm_linear(x, p, b), F.linear(x, w, b))
    close(torch.ops.vitkit.gemm_linear(x, p), F.linear(x, w))
    r = torch.randn(rows, outer, generator=g)
    close(torch.ops.vitkit.gemm_linear(x, p, b, r), F.linear(x, w, b) + r)


@needs_gemm
def test_batched_and_strided_inputs_and_no_rows():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 3, 50, 64, generator=g), torch.randn(32, 48, generator=g), torch.randn(32)
    view = x[..., 8:56]  # rows of 48 inside rows of 64: not contiguous
    p = torch.ops.vitkit.gemm_pack(w)
    y = torch.ops.vitkit.gemm_linear(view, p, b)
    assert y.shape == (2, 3, 50, 32)
    close(y, F.linear(view, w, b))
    assert torch.ops.vitkit.gemm_linear(torch.empty(0, 48), p, b).shape == (0, 32)


@needs_gemm
def test_bad_shapes_are_refused_by_name():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.vitkit.gemm_pack(torch.randn(24, 8))
    p = torch.ops.vitkit.gemm_pack(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match=r"expected fp32 input \(\.\.\., 8\)"):
        torch.ops.vitkit.gemm_linear(torch.randn(4, 9), p)
    with pytest.raises(RuntimeError, match="bias of 16"):
        torch.ops.vitkit.gemm_linear(torch.randn(4, 8), p, torch.randn(15))
    with pytest.raises(RuntimeError, match="residual of shape"):
        torch.ops.vitkit.gemm_linear(torch.randn(4, 8), p, None, torch.randn(4, 15))


@needs_gemm
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_packed_linear_on_the_operator_computes_the_layer(monkeypatch, activation):
    monkeypatch.setattr(packed, "gemm_available", lambda: True)  # offered on AVX-512 CPUs too, for the test
    torch.manual_seed(0)
    linear = nn.Linear(96, 64)
    layer = PackedLinear(linear, activation)
    assert layer.gemm_weight is not None
    monkeypatch.setattr(layer, "engine", lambda x: "gemm")
    x, r = torch.randn(2, 197, 96), torch.randn(2, 197, 64)
    with torch.inference_mode():
        want = linear(x) if activation == "none" else F.gelu(linear(x))
        close(layer(x), want)
        if activation == "none":
            close(layer.add(x, r), want + r)


def test_the_operator_is_offered_only_for_fp32_widths_it_computes(monkeypatch):
    monkeypatch.setattr(packed, "gemm_available", lambda: False)
    assert PackedLinear(nn.Linear(96, 64)).gemm_weight is None  # not on this CPU
    monkeypatch.setattr(packed, "gemm_available", lambda: pytest.fail("asked for a layer it cannot compute"))
    assert PackedLinear(nn.Linear(96, 1000)).gemm_weight is None  # 1000 outputs: not panels of 16
