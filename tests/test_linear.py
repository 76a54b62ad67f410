"""vitkit.cpu.linear.FastLinear, the linear layer of an accelerated model: nn.Linear through oneDNN on the
CPU; the same function and gradients as F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, jvp, vmap

import vitkit.cpu.linear as linear_module
import vitkit.cpu.private
from operator_helpers import operators_called
from vitkit.cpu.linear import (
    MKL_FROM_ROWS,
    MKL_MAX_ROWS,
    TRAINING_ENGINE_ENV,
    TRAINING_ENGINES,
    FastLinear,
    forced_inference_engine,
    forced_training_engine,
    inference_engine,
    inference_engine_for,
    machine_training_engine,
    rows,
    training_engine,
    use_onednn,
)

needs_onednn = pytest.mark.skipif(not vitkit.cpu.private.onednn_linear_available(),
                                  reason="this torch build has no oneDNN linear kernel")


def grads(layer: nn.Linear, x: torch.Tensor, g: torch.Tensor, reference: bool):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = F.linear(x, layer.weight, layer.bias) if reference else layer(x)
    y.backward(g)
    bias_grad = None if layer.bias is None else layer.bias.grad.clone()
    return y.detach(), x.grad.clone(), layer.weight.grad.clone(), bias_grad


@pytest.fixture
def engine(request):
    """Run the test with the training products on the engine `request.param`, whatever this CPU's default."""
    with forced_training_engine(request.param):
        yield request.param


@needs_onednn
@pytest.mark.parametrize("engine", TRAINING_ENGINES, indirect=True)
@pytest.mark.parametrize("shape,features,bias", [((6, 197, 64), (64, 192), True),
                                                 ((300, 96), (96, 48), False),
                                                 ((3, 17, 128), (128, 512), True)])
def test_forward_and_gradients_equal_f_linear(shape, features, bias, engine):
    torch.manual_seed(0)
    layer = FastLinear(*features, bias=bias)
    x = torch.randn(shape)
    g = torch.randn(*shape[:-1], features[1])
    assert use_onednn(x, layer.weight)
    ours, ref = grads(layer, x, g, reference=False), grads(layer, x, g, reference=True)
    if engine == "mkl":  # F.linear itself: the same kernels, so the same bits
        assert all(b is None if a is None else torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    for a, b in zip(ours, ref, strict=True):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("engine", TRAINING_ENGINES, indirect=True)
def test_a_second_derivative_equals_f_linears(engine):
    """create_graph=True (a gradient penalty): on oneDNN the gradients come from PyTorch's products,
    differentiable again (oneDNN's kernel has no derivative: its terms were silently zero)."""
    torch.manual_seed(1)
    layer = FastLinear(8, 6)
    x = torch.randn(5, 8, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_()
    results = []
    for inp, fn in ((x, layer), (ref_x, lambda t: F.linear(t, layer.weight, layer.bias))):
        layer.zero_grad(set_to_none=True)
        (g,) = torch.autograd.grad((fn(inp) ** 2).sum(), inp, create_graph=True)
        (g ** 2).sum().backward()
        results.append((inp.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("engine", TRAINING_ENGINES, indirect=True)
def test_the_training_engine_computes_products_that_need_a_gradient(engine):
    torch.manual_seed(0)
    layer = FastLinear(64, 32)
    x = torch.randn(10, 64)
    y = layer(x)  # the weight needs a gradient
    assert ("OneDNNLinear" in type(y.grad_fn).__name__) is (engine == "onednn")
    with torch.no_grad():  # inference: oneDNN whatever the training engine
        out = layer(x)
    assert out.grad_fn is None
    torch.testing.assert_close(out, y.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vendor,isa,expected", [
    ("GenuineIntel", "avx512", "mkl"), ("GenuineIntel", "avx2", "mkl"), ("AuthenticAMD", "avx512", "onednn"),
    ("AuthenticAMD", "avx2", "mkl"), ("", "", "onednn")])
def test_training_engine_by_vendor_isa_and_environment(monkeypatch, vendor, isa, expected):
    monkeypatch.setattr(linear_module, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(linear_module, "cpu_isa", lambda: isa)
    monkeypatch.delenv(TRAINING_ENGINE_ENV, raising=False)
    machine_training_engine.cache_clear()
    try:
        assert training_engine() == expected
        other = "onednn" if expected == "mkl" else "mkl"
        with forced_training_engine(other):
            assert training_engine() == other
        assert training_engine() == expected
        with pytest.raises(ValueError, match="training engine='cuda'"), forced_training_engine("cuda"):
            pass
        machine_training_engine.cache_clear()
        monkeypatch.setenv(TRAINING_ENGINE_ENV, other.upper())
        assert training_engine() == other
        machine_training_engine.cache_clear()
        monkeypatch.setenv(TRAINING_ENGINE_ENV, "cublas")
        with pytest.raises(ValueError, match=f"{TRAINING_ENGINE_ENV}='cublas'.*onednn, mkl"):
            training_engine()
    finally:
        machine_training_engine.cache_clear()  # the next caller reads this machine's own setting again


@needs_onednn
def test_frozen_weights_and_input_without_grad():
    torch.manual_seed(0)
    layer = FastLinear(32, 16)
    layer.weight.requires_grad_(False)
    x = torch.randn(4, 32, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(4, 32), rtol=1e-5, atol=1e-5)
    assert layer.weight.grad is None and layer.bias.grad is not None
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_other_dtypes_and_autocast_are_f_linear_exactly():
    torch.manual_seed(0)
    layer = FastLinear(32, 16).double()
    x = torch.randn(5, 32, dtype=torch.float64)
    assert not use_onednn(x, layer.weight)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    layer = FastLinear(32, 16)
    x = torch.randn(5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not use_onednn(x, layer.weight)
        out = layer(x)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, F.linear(x, layer.weight, layer.bias))


def test_gradcheck_of_the_fallback_in_float64():
    layer = FastLinear(6, 4).double()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: layer(t), (x,))


def test_without_onednn_it_is_f_linear_exactly(monkeypatch):
    """Where this PyTorch has no oneDNN linear kernel, every product is F.linear's, forward and backward."""
    monkeypatch.setattr(linear_module, "onednn_linear_available", lambda: False)
    torch.manual_seed(0)
    layer = FastLinear(32, 16)
    x, g = torch.randn(5, 7, 32), torch.randn(5, 7, 16)
    assert not use_onednn(x, layer.weight)
    for engine in TRAINING_ENGINES:
        with forced_training_engine(engine):
            ours, ref = grads(layer, x, g, reference=False), grads(layer, x, g, reference=True)
        assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_a_drop_in_for_nn_linear():
    layer = FastLinear(8, 4)
    assert isinstance(layer, nn.Linear)
    assert sorted(layer.state_dict()) == ["bias", "weight"]


@pytest.mark.parametrize("shape,expected", [((5, 32), 5), ((2, 3, 32), 6), ((1, 1, 32), 1), ((32,), 1),
                                            ((0, 32), 0)])
def test_rows_counts_every_dimension_but_the_last(shape, expected):
    assert rows(torch.empty(shape)) == expected


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 32), (2, 32), (1, 2, 32), (3, 32), (1, 4, 32)])
def test_few_rows_are_f_linear_exactly(shape):
    torch.manual_seed(0)
    layer = FastLinear(32, 16)
    x = torch.randn(shape)
    few = rows(x) <= MKL_MAX_ROWS
    assert use_onednn(x, layer.weight) is not few
    with torch.inference_mode():
        out = layer(x)
    if few:
        assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    else:
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD", ""])
def test_the_inference_engine_by_rows_and_vendor(monkeypatch, vendor):
    monkeypatch.setattr(linear_module, "cpu_vendor", lambda: vendor)
    intel = vendor == "GenuineIntel"
    expected = {1: "mkl", MKL_MAX_ROWS: "mkl", MKL_MAX_ROWS + 1: "onednn", 197: "onednn",
                MKL_FROM_ROWS - 1: "onednn", MKL_FROM_ROWS: "mkl" if intel else "onednn",
                16 * 197: "mkl" if intel else "onednn"}
    assert {n: inference_engine(n) for n in expected} == expected
    with forced_inference_engine("onednn"):
        assert [inference_engine(n) for n in (1, MKL_MAX_ROWS + 1, 16 * 197)] == ["mkl", "onednn", "onednn"]
        with forced_inference_engine("mkl"):
            assert [inference_engine(n) for n in (1, MKL_MAX_ROWS + 1, 16 * 197)] == ["mkl"] * 3
        with forced_inference_engine("auto"):
            assert {n: inference_engine(n) for n in expected} == expected
        assert inference_engine(16 * 197) == "onednn"
    assert {n: inference_engine(n) for n in expected} == expected
    with pytest.raises(ValueError,
                       match="inference engine='cuda'.*auto, onednn, mkl"), forced_inference_engine("cuda"):
        pass


@needs_onednn
@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
@pytest.mark.parametrize("n", [MKL_MAX_ROWS + 1, MKL_FROM_ROWS - 1, MKL_FROM_ROWS, 1000])
@pytest.mark.parametrize("tuning", ["off", "on"])
def test_inference_runs_the_products_on_the_inference_engine(monkeypatch, vendor, n, tuning):
    """Without a gradient, FastLinear multiplies on `inference_engine_for`'s engine: with tuning off
    `inference_engine`'s rule, with it on the faster on this machine. MKL is F.linear bit for bit, oneDNN the
    same function up to rounding; the profiler shows which kernel ran."""
    monkeypatch.setattr(linear_module, "cpu_vendor", lambda: vendor)
    monkeypatch.setenv("VITKIT_AUTOTUNE", "1" if tuning == "on" else "0")
    torch.manual_seed(0)
    layer = FastLinear(64, 48)
    x = torch.randn(n, 64)
    ref = F.linear(x, layer.weight, layer.bias)
    with torch.inference_mode():
        engine = inference_engine_for(x, layer.weight, layer.bias)
        out = layer(x)
        ops = operators_called(lambda: layer(x), "")
    assert engine in ("mkl", "onednn")
    through_mkl = engine == "mkl"
    if tuning == "off":
        assert engine == inference_engine(n)
        assert through_mkl is (vendor == "GenuineIntel" and n >= MKL_FROM_ROWS)
    assert ("mkldnn::_linear_pointwise" in ops) is not through_mkl
    if through_mkl:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("engine", TRAINING_ENGINES, indirect=True)
def test_f_linear_under_tracing_torch_func_and_forward_ad(engine):
    """torch.jit.trace (which the legacy ONNX exporter runs), torch.func's transforms and forward-mode AD get
    F.linear: oneDNN's kernel cannot be traced, and neither it nor _OneDNNLinearFunction has a batching rule,
    setup_context or forward derivative. Outside them, oneDNN again."""
    torch.manual_seed(0)
    layer = FastLinear(64, 48)
    w, b = layer.weight.detach(), layer.bias.detach()
    x, v = torch.randn(5, 4, 64), torch.randn(5, 4, 64)
    ref = F.linear(x, w, b)
    with torch.no_grad():
        traced = torch.jit.trace(layer, x)
    kinds = {node.kind() for node in traced.graph.nodes()}
    assert "aten::linear" in kinds and not any(k.startswith(("mkldnn::", "prim::PythonOp")) for k in kinds)
    assert torch.equal(traced(x), ref)  # F.linear itself
    # per-sample weight gradients of sum((x_i W^T + b)^2): 2 (x_i W^T + b)^T x_i
    per_sample = vmap(grad(lambda wt, xi: (functional_call(layer, {"weight": wt, "bias": b},
                                                           (xi,)) ** 2).sum()),
                      in_dims=(None, 0))(w, x)
    torch.testing.assert_close(per_sample, 2 * ref.transpose(1, 2) @ x, rtol=1e-5, atol=1e-5)
    for context in (torch.enable_grad(), torch.no_grad()):  # the training and the inference products
        with context:
            out, tangent = jvp(layer, (x,), (v,))
            with fwAD.dual_level():
                dual = fwAD.unpack_dual(layer(fwAD.make_dual(x, v)))
        for primal, t in ((out, tangent), dual):
            assert torch.equal(primal, ref)
            torch.testing.assert_close(t, F.linear(v, w), rtol=1e-5, atol=1e-5)
    assert use_onednn(x, layer.weight)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_torchscript_compiles_f_linear():
    torch.manual_seed(0)
    layer = FastLinear(32, 16)
    scripted = torch.jit.script(layer)
    x = torch.randn(5, 32)
    assert "aten::linear" in {node.kind() for node in scripted.graph.nodes()}
    assert torch.equal(scripted(x), F.linear(x, layer.weight, layer.bias))
