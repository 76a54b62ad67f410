"""The model under torch.jit.trace, the legacy ONNX exporter, torch.func's transforms and forward-mode AD,
plain and accelerated (vitkit.accelerate, on both training engines of `vitkit.cpu.linear`): the plain model is
PyTorch's own operators throughout (its attention falls back to the explicit softmax where SDPA's CPU kernel
has no forward derivative), and an accelerated model's layers run PyTorch's operators there too
(`vitkit.cpu.private.plain_ops_required`) instead of oneDNN's linear and vitkit's compiled operators. So the
traced graph holds standard operators only, and per-sample gradients, jacrev and jvp work and equal ordinary
autograd (through the fast paths) or finite differences."""

import copy
import io

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.func import functional_call, grad, jacrev, jvp, vmap

import vitkit
from vitkit.cpu import is_accelerated
from vitkit.cpu.linear import TRAINING_ENGINES, forced_training_engine

FLAVOURS = ("plain", *TRAINING_ENGINES)


@pytest.fixture
def engine(request):
    """The model's flavour `request.param`: "plain" (the model as create_model builds it), or accelerated with
    the training products on that engine, whatever this CPU's default."""
    if request.param == "plain":
        yield request.param
        return
    with forced_training_engine(request.param):
        yield request.param


def tiny_model(mode: str = "eval", engine: str = "plain") -> vitkit.VisionTransformer:
    """Two blocks of two 16-wide heads on 4x4 patches of 8 px and a class token: 17 tokens, where oneDNN's
    linear and vitkit's attention operator both apply; accelerated unless `engine` is "plain". No dropout, so
    training mode is deterministic."""
    torch.manual_seed(0)
    cfg = vitkit.get_config("ViT-Ti/16", image_size=32, patch_size=8, dim=32, depth=2, num_heads=2,
                            mlp_dim=64, num_classes=5)
    model = vitkit.create_model(cfg)
    with torch.no_grad():  # the classifier starts at zero: give the logits something to depend on
        model.head.weight.normal_(std=0.5)
        model.head.bias.normal_(std=0.1)
    if engine != "plain":
        assert is_accelerated(vitkit.accelerate(model))
    return model.train(mode == "train")


def images(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def foreign_operators(graph: torch.Graph) -> set[str]:
    """The nodes of a TorchScript graph that are not PyTorch's standard operators: Python autograd Functions
    (prim::PythonOp), vitkit's and oneDNN's own operators."""
    kinds = {node.kind() for node in graph.nodes()}
    return {k for k in kinds if k == "prim::PythonOp" or not k.startswith(("aten::", "prim::"))}


@pytest.mark.parametrize("engine", FLAVOURS, indirect=True)
@pytest.mark.parametrize("mode,no_grad", [("eval", True), ("eval", False), ("train", False)],
                         ids=["eval-no-grad", "eval", "train"])
def test_jit_trace_holds_standard_operators_and_equals_the_eager_model(engine, mode, no_grad):
    model = tiny_model(mode, engine)
    context = torch.no_grad() if no_grad else torch.enable_grad()
    with context:
        traced = torch.jit.trace(model, images(2, 1))
    assert not foreign_operators(traced.inlined_graph)
    x = images(3, 2)  # another batch size: the traced graph reads the shapes
    with context:
        torch.testing.assert_close(traced(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("engine", FLAVOURS, indirect=True)
def test_the_legacy_onnx_exporter_writes_standard_operators_that_onnxruntime_reproduces(engine):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    model = tiny_model("eval", engine)
    buffer = io.BytesIO()
    torch.onnx.export(model, (images(2, 1),), buffer, dynamo=False, opset_version=17, input_names=["pixels"],
                      output_names=["logits"], dynamic_axes={"pixels": {0: "batch"}, "logits": {0: "batch"}})
    proto = onnx.load_from_string(buffer.getvalue())
    assert {node.domain for node in proto.graph.node} <= {"", "ai.onnx"}
    session = ort.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    x = images(3, 2)
    (logits,) = session.run(None, {"pixels": x.numpy()})
    with torch.no_grad():
        expected = model(x)
    assert expected.abs().max() > 0.1  # logits that depend on the input
    torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("engine", FLAVOURS, indirect=True)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_per_sample_gradients_by_vmap_of_grad_equal_a_loop_of_backward_passes(engine, mode):
    model = tiny_model(mode, engine)
    x, y = images(3, 1), torch.tensor([0, 3, 4])
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for i in range(len(x)):  # ordinary autograd, through vitkit's fast paths
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(per_sample[name][i], p.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert per_sample["blocks.0.attn.qkv.weight"].abs().max() > 0  # gradients reach the first block


@pytest.mark.parametrize("engine", FLAVOURS, indirect=True)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_jacrev_equals_the_jacobian_by_backward_passes(engine, mode):
    model = tiny_model(mode, engine)
    x = images(2, 1)
    jacobian = jacrev(model)(x)  # (2, 5, 2, 3, 32, 32)
    expected = torch.autograd.functional.jacobian(model, x)  # one backward pass a logit, on the fast paths
    assert jacobian.shape == (2, 5, 2, 3, 32, 32)
    torch.testing.assert_close(jacobian, expected, rtol=1e-4, atol=1e-5)
    assert jacobian[0, :, 1].abs().max() == 0 and jacobian[0, :, 0].abs().max() > 0  # images stay apart


def forward_ad_tangent(model, x: torch.Tensor, v: torch.Tensor,
                       api: str) -> tuple[torch.Tensor, torch.Tensor]:
    if api == "torch.func.jvp":
        return jvp(model, (x,), (v,))
    with fwAD.dual_level():
        out = fwAD.unpack_dual(model(fwAD.make_dual(x, v)))
        return out.primal, out.tangent


@pytest.mark.parametrize("engine", FLAVOURS, indirect=True)
@pytest.mark.parametrize("api", ["torch.func.jvp", "forward_ad"])
@pytest.mark.parametrize("no_grad", [False, True], ids=["grad", "no-grad"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_forward_mode_derivatives_equal_finite_differences(engine, api, no_grad, mode):
    """J v by forward-mode AD against a central difference in float64 (on PyTorch's own operators). In
    evaluation mode too: PyTorch's fused CPU attention kernel (F.scaled_dot_product_attention) has no forward
    derivative, so the attention takes its explicit formula while forward AD is on."""
    model = tiny_model(mode, engine)
    x, v = images(2, 1), images(2, 2)
    with torch.no_grad() if no_grad else torch.enable_grad():
        out, tangent = forward_ad_tangent(model, x, v, api)
    reference = copy.deepcopy(model).double()
    h = 1e-3
    with torch.no_grad():
        expected = (reference(x.double() + h * v.double()) - reference(x.double() - h * v.double())) / (2 * h)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert tangent is not None and expected.abs().max() > 0.1
    torch.testing.assert_close(tangent.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
@pytest.mark.parametrize("engine", FLAVOURS, indirect=True)
def test_torchscript_compiles_the_mlp_on_pytorchs_operators(engine):
    """A block's MLP scripts, plain or accelerated: FastLinear compiles to nn.Linear's operators. (The whole
    accelerated model does not: its forward reads Python state, e.g. the autocast state, that TorchScript
    cannot.)"""
    model = tiny_model("eval", engine)
    mlp = model.blocks[0].mlp
    scripted = torch.jit.script(mlp)
    assert not foreign_operators(scripted.inlined_graph)
    x = torch.randn(2, 17, 32)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), mlp(x), rtol=1e-5, atol=1e-5)
