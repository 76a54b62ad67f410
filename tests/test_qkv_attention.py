"""vitkit.cpu.attention and its compiled operators: the attention and its gradient against the explicit
softmax(q k^T * scale) v in float64, in the shapes that exercise the query blocks and the vector tails; an
accelerated model (vitkit.accelerate) and optimize's blocks on it, the plain model never; the fallbacks where
it does not apply.

Where a C++ compiler is on PATH (and VITKIT_KERNELS is not 0) the operators must build: a test that needs them
fails if they did not (`needs_operator`, tests/operator_helpers.py)."""

import contextlib
import copy
import platform
from pathlib import Path

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.func import grad, jvp, vmap

import vitkit
import vitkit.cpu.attention as attention_module
from operator_helpers import needs_operator, operators_called, training_step_equals_the_fallback
from vitkit.attention import merge_heads, split_heads
from vitkit.cpu.attention import (
    FastAttention,
    _QKVAttention,
    explicit_attention_is_faster,
    implementation,
    keeps_probabilities,
    qkv_attention,
    qkv_attention_applies,
    sgemm_products,
)
from vitkit.cpu.build import attention_available
from vitkit.cpu.fp32_block import fp32_block_default
from vitkit.cpu.hardware import cpu_flags, cpu_isa

needs_attention_operator = needs_operator(attention_available, "attention")


def reference(qkv: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """The explicit attention, in float64."""
    q, k, v = split_heads(qkv.double(), heads)
    return merge_heads(torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v)


@needs_attention_operator
@pytest.mark.parametrize("B,T,heads,Dh", [
    # Head widths in multiples of 16 (up to 128) run on the AVX-512 register tiles where the CPU has them:
    (2, 197, 6, 64),   # ViT-S/16: two query blocks (112 + 85 rows on the tiles, 99 + 98 on sgemm)
    (1, 50, 4, 16),    # the fashion-mnist recipe's heads; rows of 50 end in a tail of 2 past the vectors
    (1, 300, 3, 32),   # three query blocks
    (2, 1, 1, 16),     # a single token
    (1, 37, 2, 48),    # tiles of three vectors of values; keys in a tail of 1 past the six-key tiles
    (2, 23, 2, 80),    # ViT-H/14's heads: tiles of four rows of five vectors
    (1, 40, 1, 128),   # the widest head on the tiles: three rows of eight vectors
    # Other widths, and CPUs without AVX-512, run on MKL's sgemm:
    (3, 17, 2, 24),
    (2, 1, 1, 8),
    (1, 20, 1, 144),
])
@pytest.mark.parametrize("keep_probs", [True, False], ids=["softmax-kept", "softmax-recomputed"])
@pytest.mark.parametrize("tiles", [True, False], ids=["tiles-where-they-apply", "sgemm"])
def test_attention_and_gradient_equal_the_explicit_formula(B, T, heads, Dh, keep_probs, tiles):
    torch.manual_seed(0)
    scale = Dh ** -0.5
    qkv = torch.randn(B, T, 3 * heads * Dh)
    grad = torch.randn(B, T, heads * Dh)
    out, lse, probs = torch.ops.vitkit.attention_forward(qkv, heads, scale, keep_probs, tiles)
    grad_qkv = torch.ops.vitkit.attention_backward(grad, qkv, out, lse, probs, heads, scale, tiles)
    ref_qkv = qkv.double().requires_grad_()
    ref = reference(ref_qkv, heads, scale)
    ref.backward(grad.double())
    assert out.shape == (B, T, heads * Dh) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(grad_qkv.double(), ref_qkv.grad, rtol=0, atol=5e-6)
    q, k, _ = split_heads(qkv.double(), heads)
    ref_lse = torch.logsumexp(q @ k.transpose(-2, -1) * scale, dim=-1)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=2e-6)
    if keep_probs:
        torch.testing.assert_close(probs.double(), torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1),
                                   rtol=0, atol=1e-6)
    if tiles:  # the autograd function runs the same operators
        x = qkv.clone().requires_grad_()
        _QKVAttention.apply(x, heads, scale, keep_probs).backward(grad)
        assert torch.equal(x.grad, grad_qkv)


@needs_attention_operator
def test_the_tiles_serve_head_widths_in_multiples_of_16_on_avx512_cpus():
    """Where the CPU has AVX-512 (as vitkit sees it: VITKIT_CPU_ISA=avx2 holds it to AVX2), head widths of 16
    to 128 in steps of 16 run on the register tiles; other widths, and other CPUs, on sgemm (both checked
    against float64 above). The softmax rows take 16 floats at a time under AVX-512, 8 under AVX2."""
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo to read the CPU's instruction sets from")
    avx512 = platform.machine() in ("x86_64", "AMD64") and cpu_isa() == "avx512"
    for width in (16, 32, 48, 64, 80, 96, 112, 128):
        assert torch.ops.vitkit.attention_tiles_apply(width) == avx512
    for width in (8, 24, 72, 144, 256):
        assert not torch.ops.vitkit.attention_tiles_apply(width)
    avx2 = cpu_isa() == "avx2" and "fma" in cpu_flags()
    assert torch.ops.vitkit.attention_row_width() == (16 if avx512 else 8 if avx2 else 4)


def test_the_softmax_is_kept_when_no_larger_than_the_mlp_activation():
    assert keeps_probabilities(197, 64)  # ViT-S/16, ViT-B/16 at 224 px
    assert keeps_probabilities(50, 16) and keeps_probabilities(17, 32)  # the Fashion-MNIST recipes
    assert not keeps_probabilities(577, 64)  # 384 px: recomputed in the backward, memory linear in T


@needs_attention_operator
@pytest.mark.parametrize("tiles", [True, False], ids=["tiles-where-they-apply", "sgemm"])
def test_the_operators_softmax_underflows_to_zero(tiles):
    """The operators themselves (the test below goes through autotune, which may take the explicit formula
    at its shape) with scores up to ~700: the terms far below each row's maximum go to exp's floor, exp(-87) ~
    1.6e-38 (its argument is clamped there; unclamped, the exponent bits would wrap), and the error against
    float64 is no larger than PyTorch's fp32 explicit attention's."""
    torch.manual_seed(1)
    qkv = torch.randn(2, 40, 3 * 2 * 16) * 6
    out, _, probs = torch.ops.vitkit.attention_forward(qkv, 2, 1.0, True, tiles)
    q, k, v = split_heads(qkv, 2)
    fp32 = merge_heads(torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v)
    ref = reference(qkv, 2, 1.0)
    assert torch.isfinite(out).all() and (probs < 2e-38).any() and probs.min() >= 0
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 2, 40))
    assert (out.double() - ref).abs().max() <= 1.5 * (fp32.double() - ref).abs().max()


@needs_attention_operator
def test_large_and_spread_logits_are_as_exact_as_pytorchs_fp32():
    """Scores up to ~700 and rows whose smallest terms underflow: the softmax subtracts each row's maximum,
    and the error against float64 is no larger than that of PyTorch's own fp32 explicit attention."""
    torch.manual_seed(1)
    qkv = (torch.randn(2, 40, 3 * 2 * 16) * 6).requires_grad_()
    out = qkv_attention(qkv, 2, 1.0)
    out.sum().backward()
    fp32_qkv = qkv.detach().clone().requires_grad_()
    q, k, v = split_heads(fp32_qkv, 2)
    fp32 = merge_heads(torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v)
    fp32.sum().backward()
    ref_qkv = qkv.detach().double().requires_grad_()
    ref = reference(ref_qkv, 2, 1.0)
    ref.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(qkv.grad).all()

    def err(a, b):
        return (a.double() - b).abs().max().item()

    assert err(fp32, ref) > 1e-5  # the case is hard for fp32 itself
    assert err(out, ref) <= 1.5 * err(fp32, ref)
    assert err(qkv.grad, ref_qkv.grad) <= 1.5 * err(fp32_qkv.grad, ref_qkv.grad)


@needs_attention_operator
def test_the_result_does_not_depend_on_the_threads(threads):
    """Each (image, head, query block) is one task computed alone: 1 and 2 threads give the same bits."""
    torch.manual_seed(2)
    qkv = torch.randn(2, 197, 3 * 96, requires_grad=True)
    grad = torch.randn(2, 197, 96)
    results = []
    for n in (1, 2):
        threads(n)
        qkv.grad = None
        out = qkv_attention(qkv, 3, 0.25)
        out.backward(grad)
        results.append((out.detach(), qkv.grad.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@needs_attention_operator
def test_without_gradient_it_is_the_forward_operator_alone():
    torch.manual_seed(3)
    qkv = torch.randn(2, 30, 3 * 64)
    with torch.inference_mode():
        plain = qkv_attention(qkv, 4, 0.25)
    assert not plain.requires_grad
    torch.testing.assert_close(plain, qkv_attention(qkv.clone().requires_grad_(), 4, 0.25).detach(), rtol=0,
                               atol=0)


@needs_attention_operator
def test_where_it_applies(monkeypatch):
    x = torch.randn(1, 5, 24)
    assert qkv_attention_applies(x)
    assert not qkv_attention_applies(x.double())  # float64 and other dtypes: PyTorch's kernels
    assert not qkv_attention_applies(x, dropout=0.1)  # attention dropout: SDPA's
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not qkv_attention_applies(x)  # fp32 under autocast: not what autocast hands the attention
        assert qkv_attention_applies(x.bfloat16())  # bf16 of autocast: computed in fp32
    assert qkv_attention_applies(x.bfloat16())  # bf16 of a bf16 model (optimize's): computed in fp32 too
    monkeypatch.setenv("VITKIT_KERNELS", "0")
    assert not qkv_attention_applies(x)


def tiny_vit() -> vitkit.VisionTransformer:
    """ViT-Ti/16's width and heads at 32 px: 4 patches + class token, 3 heads of 64."""
    torch.manual_seed(4)
    return vitkit.create_model(vitkit.get_config("ViT-Ti/16", image_size=32, num_classes=5))


@needs_attention_operator
def test_an_accelerated_model_trains_and_infers_through_it_and_equals_the_fallback(monkeypatch):
    """With timing off (VITKIT_AUTOTUNE=0) the accelerated model's attention takes the operator wherever it
    applies, in training and in inference, as do optimize's blocks (or, on AVX-512 CPUs, the fp32 block
    operator with the attention inside)."""
    monkeypatch.setenv("VITKIT_AUTOTUNE", "0")
    model = vitkit.accelerate(tiny_vit()).train()
    assert all(type(block.attn) is FastAttention for block in model.blocks)
    x = torch.randn(2, 3, 32, 32)
    called = training_step_equals_the_fallback(model, x, torch.tensor([1, 3]), monkeypatch,
                                               "vitkit::attention")
    assert called == {"vitkit::attention_forward", "vitkit::attention_backward"}
    model.eval()
    with torch.inference_mode():
        assert operators_called(lambda: model(x), "vitkit::attention") == {"vitkit::attention_forward"}
        fast = vitkit.optimize(model, "fp32")
        # where the fp32 block operator is the default (AVX-512 CPUs; untimed, AVX2 ones keep the layers) the
        # blocks run whole on it, the attention inside it
        whole = (all(b.fp32_operands is not None for b in fast.blocks)
                 and fp32_block_default() == "operator")
        assert operators_called(lambda: fast(x), "vitkit::") & {"vitkit::attention_forward",
                                                                 "vitkit::fp32_block"} == (
            {"vitkit::fp32_block"} if whole else {"vitkit::attention_forward"})
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)


@needs_attention_operator
def test_under_bf16_autocast_the_operator_computes_the_attention_in_fp32(monkeypatch):
    """Where the timing picks it under CPU bf16 autocast, the operator takes the projection cast to fp32, as
    the model's explicit attention computes it there: the training step's loss and gradients equal the plain
    model's under autocast to bf16 rounding, through vitkit's forward and backward operators."""
    picks = []

    def choose(op, shape, candidates, default):
        picks.append((op, shape))
        return "operator" if "bf16-autocast" in shape else default

    monkeypatch.setattr(attention_module.autotune, "choose", choose)
    plain = tiny_vit().train()
    with torch.no_grad():
        plain.head.weight.normal_(0, 0.05)
    fast = vitkit.accelerate(copy.deepcopy(plain))
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])

    def step(model):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    ref_loss, ref_grads = step(plain)
    called = operators_called(lambda: step(fast), "vitkit::attention")
    loss, grads = step(fast)
    assert called == {"vitkit::attention_forward", "vitkit::attention_backward"}
    assert any("bf16-autocast" in shape for _, shape in picks)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    for name, g in ref_grads.items():
        rel = ((grads[name] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert rel < 5e-2, (name, rel)


@needs_attention_operator
def test_bf16_without_gradients_computes_on_the_bf16_tiles(monkeypatch):
    """A bf16 projection with no gradient wanted (a bf16 model's inference) runs on the bf16 tiles where the
    CPU has AVX512-BF16, and that is then the fixed rule's choice; with a gradient, in fp32 as before. Either
    is the float64 attention of the bf16 inputs to bf16 rounding."""
    qkv = torch.randn(2, 37, 3 * 64).bfloat16()
    q, k, v = (t.double() for t in split_heads(qkv, 4))
    exact = merge_heads(torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v)
    tiles = attention_module.bf16_tiles_apply(16)
    assert tiles == ("avx512_bf16" in cpu_flags() or "avx512bf16" in cpu_flags())
    with torch.no_grad():
        called = operators_called(lambda: qkv_attention(qkv, 4, 0.25), "vitkit::attention")
        out = qkv_attention(qkv, 4, 0.25)
    assert called == ({"vitkit::attention_forward_bf16"} if tiles else {"vitkit::attention_forward"})
    torch.testing.assert_close(out.double(), exact, rtol=2e-2, atol=2e-2)
    if tiles:
        assert torch.equal(out, torch.ops.vitkit.attention_forward_bf16(qkv.float(), 4, 0.25).bfloat16())
    with_grad = qkv.clone().requires_grad_()
    called = operators_called(lambda: qkv_attention(with_grad, 4, 0.25), "vitkit::attention")
    assert called == {"vitkit::attention_forward"}
    monkeypatch.setenv("VITKIT_AUTOTUNE", "0")
    with torch.no_grad():
        assert implementation(qkv, 4, 0.0, False) == ("operator" if tiles else "sdpa")


@needs_attention_operator
def test_the_plain_model_never_calls_vitkits_operators_and_optimize_does(monkeypatch):
    """The model itself is plain PyTorch: no vitkit operator in its training step or its inference, until it
    is accelerated or optimized (optimize's fused blocks take the attention operator, with timing off, whether
    or not the model was accelerated first)."""
    monkeypatch.setenv("VITKIT_AUTOTUNE", "0")
    model = tiny_vit().train()
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    assert operators_called(lambda: F.cross_entropy(model(x), y).backward(), "vitkit::") == set()
    model.eval()
    with torch.inference_mode():
        assert operators_called(lambda: model(x), "vitkit::") == set()
        fast = vitkit.optimize(model, "fp32")
        # where the fp32 block operator is the default (AVX-512 CPUs; untimed, AVX2 ones keep the layers) the
        # blocks run whole on it, the attention inside it
        whole = (all(b.fp32_operands is not None for b in fast.blocks)
                 and fp32_block_default() == "operator")
        assert operators_called(lambda: fast(x), "vitkit::") & {"vitkit::attention_forward",
                                                                 "vitkit::fp32_block"} == (
            {"vitkit::fp32_block"} if whole else {"vitkit::attention_forward"})
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)


def test_without_the_operator_short_sequences_train_through_the_explicit_attention(monkeypatch):
    """An accelerated model training on the CPU without vitkit's attention operator, timing off (the fixed
    rule): short sequences take the explicit attention (faster there), long ones PyTorch's fused kernel; both
    give the same loss and gradients, those of the plain model."""
    monkeypatch.setenv("VITKIT_KERNELS", "0")
    monkeypatch.setenv("VITKIT_AUTOTUNE", "0")
    torch.manual_seed(0)
    cfg = vitkit.ViTConfig(image_size=32, patch_size=8, dim=32, depth=2, num_heads=4, mlp_dim=64,
                           num_classes=10)
    model = vitkit.create_model(cfg).train()
    for p in model.parameters():  # away from the zero-initialised head, so every gradient is non-zero,
        p.data.normal_(0, 0.3)  # and with peaked attention, so that the softmax matters
    x, y = torch.randn(3, 3, 32, 32), torch.tensor([0, 1, 2])
    assert explicit_attention_is_faster(model.embed(x), training=True)
    assert not explicit_attention_is_faster(model.embed(x), training=False)
    assert not explicit_attention_is_faster(torch.zeros(1, 197, 8), training=True)

    def loss_and_grads():
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def sdpa_calls():
        return operators_called(lambda: F.cross_entropy(model(x), y).backward(),
                                "aten::scaled_dot_product_attention")

    plain_loss, plain_grads = loss_and_grads()
    vitkit.accelerate(model)
    assert not sdpa_calls()  # every block on the explicit products
    explicit_loss, explicit_grads = loss_and_grads()
    # every sequence takes the kernel
    monkeypatch.setattr(attention_module, "EXPLICIT_ATTENTION_MAX_TOKENS", 0)
    assert sdpa_calls()
    fused_loss, fused_grads = loss_and_grads()
    for loss in (explicit_loss, fused_loss):
        torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-6)
    for name, g in plain_grads.items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(explicit_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


@needs_attention_operator
def test_the_operator_refuses_bad_input_with_a_clear_error():
    with pytest.raises(RuntimeError, match="expected the contiguous fp32 q;k;v projection"):
        torch.ops.vitkit.attention_forward(torch.randn(2, 5, 24).double(), 2, 0.5, False)
    with pytest.raises(RuntimeError, match="is not 3 x 5 heads"):
        torch.ops.vitkit.attention_forward(torch.randn(2, 5, 24), 5, 0.5, False)


@needs_attention_operator
def test_a_second_derivative_equals_pytorchs():
    """create_graph=True (a gradient penalty): the gradient comes from PyTorch's operators, differentiable
    again; it equals the explicit formula's second derivative."""
    torch.manual_seed(6)
    qkv = torch.randn(2, 7, 3 * 32, dtype=torch.float32, requires_grad=True)
    ref_qkv = qkv.detach().double().requires_grad_()
    for inp, fn in ((qkv, lambda t: qkv_attention(t, 2, 0.25)), (ref_qkv, lambda t: reference(t, 2, 0.25))):
        (g,) = torch.autograd.grad((fn(inp) ** 2).sum(), inp, create_graph=True)
        (g ** 2).sum().backward()
    torch.testing.assert_close(qkv.grad.double(), ref_qkv.grad, rtol=1e-4, atol=1e-5)


@needs_attention_operator
def test_sgemm_products_turns_the_tiles_off_in_the_model_path():
    """Inside `sgemm_products()` the autograd function and the inference call pass tiles=False to the
    operators, forward and backward; outside, the tiles (where they apply)."""
    torch.manual_seed(4)
    qkv = torch.randn(2, 50, 3 * 128)
    grad = torch.randn(2, 50, 128)
    ops = torch.ops.vitkit
    for tiles in (True, False):
        context = contextlib.nullcontext() if tiles else sgemm_products()
        x = qkv.clone().requires_grad_()
        with context:
            out = qkv_attention(x, 4, 0.25)
            out.backward(grad)
            with torch.no_grad():
                inference = qkv_attention(qkv, 4, 0.25)
        expected = ops.attention_forward(qkv, 4, 0.25, keeps_probabilities(50, 32), tiles)
        assert torch.equal(out.detach(), expected[0])
        assert torch.equal(x.grad, ops.attention_backward(grad, qkv, *expected, 4, 0.25, tiles))
        assert torch.equal(inference, ops.attention_forward(qkv, 4, 0.25, False, tiles)[0])


@needs_attention_operator
def test_not_under_tracing_torch_func_or_forward_ad():
    """Under torch.jit.trace (which the legacy ONNX exporter runs), in torch.func's transforms and with
    forward-mode AD the model keeps PyTorch's attention: the operators have no place in a traced graph, and
    neither they nor _QKVAttention has a batching rule, setup_context or forward derivative (tests/
    test_model_transforms.py runs the model there). Outside them, the operators again."""
    qkv = torch.randn(3, 2, 5, 96)  # vmap takes the first axis off
    decisions = []

    def probe(t: torch.Tensor) -> torch.Tensor:
        decisions.append(qkv_attention_applies(t))
        return t * 2

    torch.jit.trace(probe, qkv[0], check_trace=False)
    vmap(probe)(qkv)
    grad(lambda t: probe(t).sum())(qkv[0])
    jvp(probe, (qkv[0],), (qkv[0],))
    with fwAD.dual_level():
        probe(fwAD.make_dual(qkv[0], qkv[0]))
    assert decisions == [False] * 5
    assert qkv_attention_applies(qkv[0])


def _graph_calls_the_operator(gm: torch.fx.GraphModule) -> bool:
    """Whether a graph torch.compile captured, or one of its subgraphs (an autograd.Function's forward and
    backward), calls vitkit's attention operator."""
    return "vitkit.attention_forward" in gm.print_readable(print_output=False)


def two_block_accelerated_vit() -> vitkit.VisionTransformer:
    """ViT-Ti/16's width at 32 px in 8-pixel patches, two blocks, accelerated (seed 0)."""
    torch.manual_seed(0)
    cfg = vitkit.get_config("ViT-Ti/16", image_size=32, patch_size=8, num_classes=10, depth=2)
    return vitkit.accelerate(vitkit.VisionTransformer(cfg))


def compiled_recording_graphs(model: torch.nn.Module) -> tuple[torch.nn.Module, list[torch.fx.GraphModule]]:
    """`model` through torch.compile (dynamo reset first) with a backend that runs each captured graph as it
    is and records it in the returned list."""
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(model, backend=recording_backend), graphs


@needs_attention_operator
@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_under_torch_compile_an_accelerated_model_attends_on_the_operator(amp):
    """torch.compile traces the operator (its fake kernels give the output shapes): the captured graph calls
    it, and the compiled model's logits and gradients equal the eager model's."""
    eager = two_block_accelerated_vit()
    model = copy.deepcopy(eager)
    compiled, graphs = compiled_recording_graphs(model)
    x = torch.randn(3, 3, 32, 32)
    context = torch.autocast("cpu", dtype=amp) if amp else contextlib.nullcontext()
    with context:
        want, got = eager(x), compiled(x)
    want.float().square().sum().backward()
    got.float().square().sum().backward()
    assert graphs and any(_graph_calls_the_operator(gm) for gm in graphs)
    tol = dict(atol=1e-5, rtol=1e-5) if amp is None else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    for (name, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, **tol, msg=name)


@needs_attention_operator
def test_bf16_inference_under_torch_compile_keeps_the_fp32_operator(recwarn):
    """Under torch.compile, bf16 inference traces the fp32 operator (which has fake kernels), not the bf16
    tiles: one graph, no warning from dynamo, the eager model's logits to bf16 rounding."""
    model = two_block_accelerated_vit().eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.05)
    compiled, graphs = compiled_recording_graphs(model)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x)
        got = compiled(x)
    text = "".join(gm.print_readable(print_output=False) for gm in graphs)
    assert len(graphs) == 1 and "vitkit.attention_forward(" in text and "attention_forward_bf16" not in text
    assert not [w for w in recwarn if "dynamo" in str(w.message).lower() or "lru_cache" in str(w.message)]
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


@needs_attention_operator
def test_inductor_compiles_a_training_step_through_the_operator():
    """With inductor (the default backend) the fake kernels and the operator's backward work through AOT
    autograd: a compiled training step's loss and gradients equal the eager step's."""
    torch.manual_seed(0)
    cfg = vitkit.get_config("ViT-Ti/16", image_size=16, patch_size=8, num_classes=4, depth=1, dim=32,
                            num_heads=2, mlp_dim=64)
    eager = vitkit.accelerate(vitkit.VisionTransformer(cfg))
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    x, y = torch.randn(2, 3, 16, 16), torch.tensor([1, 3])
    want, got = F.cross_entropy(eager(x), y), F.cross_entropy(compiled(x), y)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_under_torch_compile_without_the_operator_the_model_compiles_plain(monkeypatch):
    """Where the operator is unavailable the compiled model keeps PyTorch's attention."""
    monkeypatch.setattr(attention_module, "attention_available", lambda: False)
    cfg = vitkit.get_config("ViT-Ti/16", image_size=16, patch_size=8, num_classes=4, depth=1)
    model = vitkit.accelerate(vitkit.VisionTransformer(cfg))
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=lambda gm, inputs: (graphs.append(gm), gm.forward)[1])
    compiled(torch.randn(2, 3, 16, 16)).sum().backward()
    assert graphs and not any(_graph_calls_the_operator(gm) for gm in graphs)
