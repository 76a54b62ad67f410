"""vitkit.gelu and its compiled operators: GELU and its derivative, exact and tanh, against PyTorch's in
float64; the special values, the tails of the vectors, in place and strided inputs; the model on it; the
fallbacks where it does not apply."""

import shutil

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.func import grad, jvp, vmap

import vitkit
from operator_helpers import operators_called, training_step_equals_the_fallback
from vitkit import kernels
from vitkit.gelu import GELU, gelu, gelu_, gelu_applies

needs_operator = pytest.mark.skipif(
    (shutil.which("c++") is None and shutil.which("g++") is None) or not kernels.gelu_available(),
    reason="vitkit's GELU operators are not built here (no C++ compiler)")

FLAVOURS = ["none", "tanh"]


def inputs() -> torch.Tensor:
    """Every range the polynomials cover and beyond: a dense sweep of [-12, 12] (the pieces' ends at multiples
    of 6/16 included), normal values, and large ones."""
    torch.manual_seed(0)
    pieces = torch.arange(-16, 17) * (6 / 16)
    return torch.cat([torch.linspace(-12, 12, 200_001), pieces, torch.randn(10_000) * 3, torch.tensor([-1e4, 1e4])])


@needs_operator
@pytest.mark.parametrize("approximate", FLAVOURS)
def test_gelu_and_its_gradient_equal_pytorchs_in_float64(approximate):
    x = inputs().requires_grad_()
    ref_x = x.detach().double().requires_grad_()
    ref = F.gelu(ref_x, approximate=approximate)
    y = gelu(x, approximate)
    grad = torch.randn_like(y)
    y.backward(grad)
    ref.backward(grad.double())
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=0, atol=1e-6)
    # no less exact than PyTorch's own fp32 GELU (max error ~1e-6 over this sweep)
    torch_err = (F.gelu(x.detach(), approximate=approximate).double() - ref.detach()).abs().max()
    assert (y.detach().double() - ref.detach()).abs().max() <= max(torch_err, 1e-6)


@needs_operator
@pytest.mark.parametrize("approximate", FLAVOURS)
def test_the_ends_are_exact_and_nan_stays_nan(approximate):
    x = torch.tensor([100.0, -100.0, 7.0, 0.0, float("nan")])
    y = torch.ops.vitkit.gelu(x, approximate)
    assert y[0] == 100.0 and y[1] == 0.0 and y[2] == 7.0 and y[3] == 0.0 and y[4].isnan()
    g = torch.ops.vitkit.gelu_backward(torch.ones(5), x, approximate)
    assert g[0] == 1.0 and g[1] == 0.0 and g[3] == 0.5 and g[4].isnan()


@needs_operator
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 16_384 * 2 + 5])
def test_every_length_and_its_tail(n):
    """Lengths that end inside a vector of 16, and one that splits into tasks with a tail."""
    torch.manual_seed(n)
    x = torch.randn(n) * 4
    g = torch.randn(n)
    torch.testing.assert_close(torch.ops.vitkit.gelu(x, "none"), F.gelu(x.double()).float(), rtol=0, atol=1e-6)
    ref = torch.ops.aten.gelu_backward(g.double(), x.double())
    torch.testing.assert_close(torch.ops.vitkit.gelu_backward(g, x, "none"), ref.float(), rtol=0, atol=1e-6)


@needs_operator
def test_in_place_and_strided_inputs():
    torch.manual_seed(1)
    x = torch.randn(40, 24)
    expected = torch.ops.vitkit.gelu(x, "none")
    y = x.clone()
    assert gelu_(y) is y and torch.equal(y, expected)  # written over its input
    strided = x.t()  # not contiguous: the operator reads a contiguous copy; gelu_ falls back to torch's
    torch.testing.assert_close(gelu(strided), expected.t(), rtol=0, atol=0)
    z = x.clone().t()
    assert gelu_(z) is z
    torch.testing.assert_close(z, F.gelu(x).t(), rtol=0, atol=1e-6)  # torch: scalar erf when strided
    g = torch.randn(24, 40)
    torch.testing.assert_close(torch.ops.vitkit.gelu_backward(g, strided, "none"),
                               torch.ops.vitkit.gelu_backward(g.contiguous(), strided.contiguous(), "none"))


@needs_operator
def test_the_result_does_not_depend_on_the_threads(threads):
    x = torch.randn(197, 1536)
    results = []
    for n in (1, 2):
        threads(n)
        results.append((torch.ops.vitkit.gelu(x, "none"), torch.ops.vitkit.gelu_backward(x, x, "tanh")))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@needs_operator
def test_where_it_applies(monkeypatch):
    x = torch.randn(3, 8)
    assert gelu_applies(x)
    assert not gelu_applies(x.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not gelu_applies(x)
    torch.testing.assert_close(gelu(x.double()), F.gelu(x.double()), rtol=0, atol=0)  # torch's, in float64
    monkeypatch.setenv("VITKIT_KERNELS", "0")
    assert not gelu_applies(x)


def test_the_module_is_an_nn_gelu():
    """A drop-in: optimize's fusion and anything that asks for nn.GELU still finds it; no state."""
    act = GELU(approximate="tanh")
    assert isinstance(act, nn.GELU) and act.approximate == "tanh" and not act.state_dict()
    model = vitkit.create_model(vitkit.get_config("ViT-Ti/16", image_size=32, num_classes=5))
    assert all(isinstance(b.mlp.act, GELU) for b in model.blocks)


@needs_operator
@pytest.mark.parametrize("flavour", ["exact", "tanh"])
def test_the_model_trains_through_it_and_equals_the_fallback(monkeypatch, flavour):
    torch.manual_seed(4)
    cfg = vitkit.get_config("ViT-Ti/16", image_size=32, num_classes=5, gelu=flavour)
    model = vitkit.create_model(cfg).train()
    x = torch.randn(2, 3, 32, 32)
    called = training_step_equals_the_fallback(model, x, torch.tensor([1, 3]), monkeypatch, "vitkit::gelu")
    assert called == {"vitkit::gelu", "vitkit::gelu_backward"}
    model.eval()
    with torch.inference_mode():
        assert operators_called(lambda: model(x), "vitkit::gelu") == {"vitkit::gelu"}
        # optimize(fp32) fuses GELU into oneDNN's fc1; the last block's two class-token rows go through MKL and
        # the operator in place
        fast = vitkit.optimize(model, "fp32")
        assert operators_called(lambda: fast(x), "vitkit::gelu") == {"vitkit::gelu_"}
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)


@needs_operator
def test_the_operators_refuse_bad_input_with_a_clear_error():
    with pytest.raises(RuntimeError, match="approximate must be 'none' or 'tanh', got 'erf'"):
        torch.ops.vitkit.gelu(torch.randn(3), "erf")
    with pytest.raises(RuntimeError, match="expected the input as fp32 on the CPU"):
        torch.ops.vitkit.gelu(torch.randn(3).double(), "none")
    with pytest.raises(RuntimeError, match="must be contiguous"):
        torch.ops.vitkit.gelu_(torch.randn(4, 3).t(), "none")
    with pytest.raises(RuntimeError, match=r"gradient \[2\] for an input of \[3\]"):
        torch.ops.vitkit.gelu_backward(torch.randn(2), torch.randn(3), "none")


@needs_operator
@pytest.mark.parametrize("approximate", FLAVOURS)
def test_a_second_derivative_equals_pytorchs(approximate):
    """create_graph=True (a gradient penalty): the gradient is PyTorch's own, differentiable again."""
    torch.manual_seed(5)
    x = torch.randn(50, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_()
    for inp, fn in ((x, gelu), (ref_x, lambda t, a: F.gelu(t, approximate=a))):
        (g,) = torch.autograd.grad((fn(inp, approximate) ** 2).sum(), inp, create_graph=True)
        (g ** 2).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-6)


@needs_operator
@pytest.mark.parametrize("approximate", FLAVOURS)
def test_f_gelu_under_tracing_torch_func_and_forward_ad(approximate):
    """torch.jit.trace (which the legacy ONNX exporter runs), torch.func's transforms and forward-mode AD get
    F.gelu: vitkit's operators have no place in a traced graph, and neither they nor _GELU has a batching rule,
    setup_context or forward derivative. Outside them, the operators again."""
    torch.manual_seed(6)
    x, v = torch.randn(4, 6, 16), torch.randn(4, 6, 16)
    ref = F.gelu(x, approximate=approximate)
    with torch.no_grad():
        traced = torch.jit.trace(GELU(approximate), x)
    kinds = {node.kind() for node in traced.graph.nodes()}
    assert "aten::gelu" in kinds and not any(k.startswith(("vitkit::", "prim::PythonOp")) for k in kinds)
    assert torch.equal(traced(x), ref)  # F.gelu itself
    ref_x = x.clone().requires_grad_()
    (derivative,) = torch.autograd.grad(F.gelu(ref_x, approximate=approximate).sum(), ref_x)  # GELU'(x)
    per_sample = vmap(grad(lambda t: gelu(t, approximate).sum()))(x)
    torch.testing.assert_close(per_sample, derivative, rtol=1e-5, atol=1e-6)
    for context in (torch.enable_grad(), torch.no_grad()):
        with context:
            out, tangent = jvp(lambda t: gelu(t, approximate), (x,), (v,))
            with fwAD.dual_level():
                dual = fwAD.unpack_dual(GELU(approximate)(fwAD.make_dual(x, v)))
        for primal, t in ((out, tangent), dual):
            assert torch.equal(primal, ref)
            torch.testing.assert_close(t, derivative * v, rtol=1e-5, atol=1e-6)
    assert gelu_applies(x)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
@pytest.mark.parametrize("approximate", FLAVOURS)
def test_torchscript_compiles_f_gelu(approximate):
    x = torch.randn(5, 32)
    scripted = torch.jit.script(GELU(approximate))
    assert "aten::gelu" in {node.kind() for node in scripted.graph.nodes()}
    assert torch.equal(scripted(x), F.gelu(x, approximate=approximate))
