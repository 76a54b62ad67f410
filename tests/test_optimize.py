"""vitkit.optimize: the fast paths compute the model's function (fp32 to 1e-4, int8 to >= 99 % top-1
agreement), leave the original alone and refuse what they cannot do."""


import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import vitkit
import vitkit.attention
from operator_helpers import operators_called
from vitkit import inference
from vitkit.cpu import is_accelerated
from vitkit.cpu.convert import pack_linears
from vitkit.cpu.fused_block import FusedBlock, attend_through_projections
from vitkit.cpu.hardware import cpu_has_native_bf16
from vitkit.cpu.int8 import DynamicInt8Linear
from vitkit.cpu.linear import MKL_FROM_ROWS, MKL_MAX_ROWS
from vitkit.cpu.packed import LinearPatchEmbed, PackedLinear
from vitkit.cpu.private import onednn_packing_available
from vitkit.inference import optimize

NO_PACKING = "this torch build has no oneDNN linear kernel or weight packing"
TINY = dict(image_size=32, patch_size=8, dim=64, depth=2, num_heads=4, mlp_dim=128, num_classes=10)


def tiny_model(**overrides) -> vitkit.VisionTransformer:
    """A tiny ViT with random weights everywhere (vitkit's classifier starts at zero, which would hide
    errors)."""
    model = vitkit.create_model(vitkit.ViTConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, p.shape[-1] ** -0.5)
            else:
                p.normal_(0, 0.1)
    return model


def optimize_copy(module: nn.Module) -> nn.Module:
    """An eval-mode copy of `module` without gradients, as optimize starts from."""
    return copy.deepcopy(module).eval().requires_grad_(False)


@pytest.mark.parametrize("overrides", [{}, {"gelu": "tanh"}, {"pool": "gap"}, {"representation_size": 48}])
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_fp32_computes_the_same_function(overrides, batch):
    model = tiny_model(**overrides)
    fast = optimize(model, "fp32")
    x = torch.randn(batch, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), model(x), rtol=0, atol=1e-4)
        # The interface survives: features and every block's attention, equal too.
        f_ref, a_ref = model.forward_features(x, return_attention=True)
        f_fast, a_fast = fast.forward_features(x, return_attention=True)
    torch.testing.assert_close(f_fast, f_ref, rtol=0, atol=1e-4)
    for a, b in zip(a_fast, a_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("overrides", [{}, {"pool": "gap", "class_token": False},
                                       {"hybrid_layers": (1,), "patch_size": 2, "image_size": 64}])
def test_an_empty_batch_gives_empty_outputs_as_the_model_does(precision, overrides):
    model = tiny_model(**overrides)
    fast = optimize(model, precision)
    x = torch.randn(0, 3, *model.cfg.image_size)
    with torch.inference_mode():
        assert fast(x).shape == model(x).shape == (0, 10)
        assert fast.forward_features(x).shape == model.forward_features(x).shape


@pytest.mark.skipif(not onednn_packing_available(), reason=NO_PACKING)
def test_fp32_packs_every_linear_and_fuses_gelu():
    fast = optimize(tiny_model(), "fp32")
    assert not any(type(m) is nn.Linear for m in fast.modules())
    for block in fast.blocks:
        assert isinstance(block.mlp.fc1, PackedLinear) and block.mlp.fc1.activation == "gelu"
        assert isinstance(block.mlp.act, nn.Identity)
        assert isinstance(block.attn.qkv, PackedLinear) and block.attn.qkv.activation == "none"


@pytest.mark.parametrize("queries", [1, 3])
def test_attending_through_the_projections_equals_projecting_every_token(queries):
    B, T, D, H = 2, 11, 12, 3
    h = torch.randn(B, T, D, dtype=torch.float64)
    qkv = nn.Linear(D, 3 * D).double()
    nn.init.normal_(qkv.bias)  # a key bias too: the softmax must not see it
    q, k, v = vitkit.attention.split_heads(qkv(h), H)
    ref = F.scaled_dot_product_attention(q[:, :, :queries], k, v)
    w = qkv.weight.detach()
    out = attend_through_projections(q[:, :, :queries], h, w[D:2 * D].reshape(H, D // H, D),
                                     w[2 * D:].reshape(H, D // H, D),
                                     qkv.bias.detach()[2 * D:].reshape(H, 1, D // H),
                                     (D // H) ** -0.5)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_attending_through_the_projections_copies_no_tokens_per_head():
    """With several images, no operator sees a tensor bigger than the tokens themselves: a product broadcast
    over the heads would copy every image's tokens once per head."""
    B, T, D, H, queries = 4, 50, 48, 6, 1
    h = torch.randn(B, T, D)
    q = torch.randn(B, H, queries, D // H)
    w_k, w_v, b_v = torch.randn(H, D // H, D), torch.randn(H, D // H, D), torch.randn(H, 1, D // H)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        attend_through_projections(q, h, w_k, w_v, b_v, 0.125)
    shapes = [shape for event in prof.events() for shape in event.input_shapes if shape]
    assert shapes and max(math.prod(shape) for shape in shapes) <= B * T * D


@pytest.mark.skipif(not onednn_packing_available(), reason=NO_PACKING)
@pytest.mark.parametrize("queries", [None, 1, 2, 40])  # 40 queries take the q;k;v product again
def test_fused_block_computes_the_block(queries, monkeypatch):
    model = tiny_model(image_size=48)  # 37 tokens
    block = model.blocks[0]
    fused = pack_linears(FusedBlock(optimize_copy(block), few_queries=True))
    x = torch.randn(2, 37, 64)
    with torch.inference_mode():
        ref, _ = block(x, queries=queries)
        # Block's own forward (the unfused path) is not taken.
        monkeypatch.setattr(vitkit.model.Block, "forward", lambda *a, **k: pytest.fail("fell back to Block"))
        out, attn = fused(x, queries=queries)
    assert attn is None
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@pytest.mark.skipif(not onednn_packing_available(), reason=NO_PACKING)
def test_fp32_fuses_the_blocks_and_the_patch_projection():
    model = tiny_model()
    fast = optimize(model, "fp32")
    assert all(isinstance(b, FusedBlock) and not b.training for b in fast.blocks)
    assert [b.query is not None for b in fast.blocks] == [False, True]  # only the last one takes few queries
    # no shortcut with GAP
    assert all(b.query is None for b in optimize(tiny_model(pool="gap"), "fp32").blocks)
    assert isinstance(fast.patch_embed, LinearPatchEmbed) and isinstance(fast.patch_embed.proj, PackedLinear)
    x = torch.randn(3, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(fast.patch_embed(x), model.patch_embed(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_an_accelerated_model_optimizes_as_the_plain_one(precision):
    """optimize converts an accelerated model's layers (FastLinear, FastAttention) as it does a plain model's:
    the same result, and the accelerated model itself is left accelerated."""
    model = tiny_model()
    accelerated = vitkit.accelerate(copy.deepcopy(model))
    fast, fast_plain = optimize(accelerated, precision), optimize(model, precision)
    assert is_accelerated(accelerated)
    if onednn_packing_available():  # every linear layer packed or int8, FastLinear too
        assert not any(isinstance(m, nn.Linear) for m in fast.modules())
    x = torch.randn(3, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), fast_plain(x), rtol=0, atol=1e-6)
        f, attentions = fast.forward_features(x, return_attention=True)
        f_plain, attentions_plain = fast_plain.forward_features(x, return_attention=True)
    torch.testing.assert_close(f, f_plain, rtol=0, atol=1e-6)
    for a, b in zip(attentions, attentions_plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_optimize_returns_a_copy_for_inference():
    model = tiny_model()
    model.train()
    x = torch.randn(2, 3, 32, 32)
    fast = optimize(model, "fp32")
    assert fast is not model and not fast.training
    assert not any(p.requires_grad for p in fast.parameters())
    # The original is untouched: still training, plain linear layers, gradients on.
    assert model.training and isinstance(model.blocks[0].mlp.fc1, nn.Linear)
    assert all(p.requires_grad for p in model.parameters())
    model.eval()
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), model(x), rtol=0, atol=1e-4)


def test_bf16_on_a_cpu_without_native_bf16_is_refused_with_a_reason(monkeypatch):
    monkeypatch.setattr(inference, "cpu_has_native_bf16", lambda: False)
    with pytest.raises(ValueError, match="native bf16"):
        optimize(tiny_model(), "bf16")


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="this CPU has no native bf16 (AVX512-BF16 or AMX)")
def test_bf16_on_a_cpu_with_native_bf16_is_close():
    model = tiny_model()
    fast = optimize(model, "bf16")
    x = torch.randn(8, 3, 32, 32)
    with torch.inference_mode():
        out, ref = fast(x), model(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05 * ref.abs().max().item())


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="this CPU has no native bf16 (AVX512-BF16 or AMX)")
def test_bf16_on_the_cpu_runs_fused_blocks_of_packed_bf16_layers():
    """On a CPU with native bf16 the bf16 model is the fp32 one's structure in bf16: FusedBlocks whose linear
    layers are oneDNN-packed bf16 (GELU fused into fc1), the class-token shortcut's few-query block included;
    every entry point stays close to fp32 at batch 1 and 8, and a conversion out of bf16 is refused."""
    if not onednn_packing_available():
        pytest.skip(NO_PACKING)
    model = tiny_model()
    fast = optimize(model, "bf16")
    assert all(isinstance(b, FusedBlock) for b in fast.blocks)
    linears = [m for m in fast.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.dtype == torch.bfloat16 and m.plain_weight.dtype == torch.bfloat16
                           for m in linears)
    assert all(b.mlp.fc1.activation == "gelu" and isinstance(b.mlp.act, nn.Identity) for b in fast.blocks)
    assert not any(isinstance(m, nn.Linear) for m in fast.modules())
    with torch.inference_mode():
        for batch in (1, 8):
            x = torch.randn(batch, 3, 32, 32)
            out, ref = fast(x), model(x)
            assert out.dtype == torch.float32
            torch.testing.assert_close(out, ref, rtol=0, atol=0.05 * ref.abs().max().item())
        tokens, attn = fast.forward_features(x, return_attention=True)
        ref_tokens, _ = model.forward_features(x, return_attention=True)
        assert tokens.dtype == torch.float32 and len(attn) == len(fast.blocks)
        torch.testing.assert_close(tokens, ref_tokens, rtol=0, atol=0.1)
    with pytest.raises(TypeError, match="cannot be converted"):
        fast.float()


def test_bf16_keeps_the_fp32_interface_of_every_entry_point():
    # The casts optimize(model, "bf16") adds, run on any CPU (emulated bf16 is slow, not wrong).
    model = tiny_model()
    fast = inference._cast_bf16(optimize_copy(model))
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        ref_tokens, ref_attn = model.forward_features(x, return_attention=True)
        tokens, attn = fast.forward_features(x, return_attention=True)
        assert tokens.dtype == torch.float32 and all(a.dtype == torch.float32 for a in attn)
        torch.testing.assert_close(tokens, ref_tokens, rtol=0, atol=0.1)
        torch.testing.assert_close(fast.forward_features(x), ref_tokens, rtol=0, atol=0.1)
        for out in (fast(x), fast.forward_head(ref_tokens)):
            assert out.dtype == torch.float32
            torch.testing.assert_close(out, model(x), rtol=0, atol=0.05 * model(x).abs().max().item())


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_an_optimized_model_is_neither_saved_nor_optimized_again(precision, tmp_path):
    fast = optimize(tiny_model(), precision)
    with pytest.raises(ValueError, match=f"comes from vitkit.optimize\\(precision='{precision}'\\)"):
        vitkit.save(fast, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(ValueError, match="already comes from vitkit.optimize"):
        optimize(fast)
    if onednn_packing_available():
        with pytest.raises(TypeError, match="cannot be copied"):
            copy.deepcopy(fast)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_an_optimized_model_gives_no_state_dict_that_lacks_its_weights(precision, tmp_path):
    """Packed and int8 weights are no parameters: a state dict (or a pickle) of the optimized model would lack
    every linear weight and load into a different model, silently. Both raise, saying what to save instead."""
    fast = optimize(tiny_model(), precision)
    if not any(isinstance(m, (PackedLinear, DynamicInt8Linear)) for m in fast.modules()):
        pytest.skip("no packed layers on this machine: the state dict is a plain one")
    with pytest.raises(TypeError, match="save the model you passed to vitkit.optimize"):
        fast.state_dict()
    with pytest.raises(TypeError, match="save the model you passed to vitkit.optimize"):
        torch.save(fast, tmp_path / "fast.pt")


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_an_optimized_model_refuses_another_dtype_or_device_at_once(precision):
    """Its packed layers stay fp32 on the CPU whatever .to() does to the rest: a converted model failed only
    when called. A conversion to anything else is refused at once; one to what it is (fp32, the CPU) is
    harmless."""
    fast = optimize(tiny_model(), precision)
    if not any(isinstance(m, (PackedLinear, DynamicInt8Linear)) for m in fast.modules()):
        pytest.skip("no packed layers on this machine: a plain model converts as any")
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        before = fast(x)
    for convert in (lambda m: m.double(), lambda m: m.half(), lambda m: m.to(torch.bfloat16)):
        with pytest.raises(TypeError, match="convert the model itself and optimize that"):
            convert(fast)
    fast.float().to("cpu")
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), before, rtol=0, atol=0)


def test_torch_compiles_wrapper_is_refused():
    with pytest.raises(ValueError, match="not torch.compile's wrapper"):
        optimize(torch.compile(tiny_model()))


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_an_optimized_model_ignores_cpu_autocast(precision):
    """Its packed and int8 layers compute in fp32 only; under bf16 autocast it gives its fp32 result (the
    attention's output used to reach them in bf16 and be refused)."""
    model = tiny_model()
    fast = optimize(model, precision)
    for batch in (1, 3):  # the classifier's rows on MKL (at most two) and on the tuned engine
        x = torch.randn(batch, 3, 32, 32)
        with torch.inference_mode():
            expected = fast(x)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got = fast(x)
                features = fast.forward_features(x, return_attention=True)[0]
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
            torch.testing.assert_close(features, fast.forward_features(x, return_attention=True)[0], rtol=0,
                                       atol=1e-6)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="precision='fp16'"):
        optimize(tiny_model(), "fp16")
    with pytest.raises(ValueError, match="compile='yes'"):
        optimize(tiny_model(), "fp32", compile="yes")
    with pytest.raises(ValueError, match="int8"):
        optimize(tiny_model(), "int8", compile=True)
    # A float64 or float16 model used to be packed as float32 and fail on every call afterwards.
    for dtype in (torch.float64, torch.float16):
        for precision in ("fp32", "int8"):
            with pytest.raises(ValueError, match=f"parameters are {dtype}: call model.float"):
                optimize(tiny_model().to(dtype), precision)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_no_gradient_reaches_the_input_and_backward_says_so(precision):
    """The optimized layers carry no gradients: backward() through the output raises instead of succeeding
    with the input's .grad left None."""
    fast = optimize(tiny_model(), precision)
    x = torch.randn(2, 3, 32, 32, requires_grad=True)
    y = fast(x)
    assert not y.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()


@pytest.mark.skipif(not onednn_packing_available(), reason=NO_PACKING)
@pytest.mark.parametrize("tuning", ["on", "off"])
@pytest.mark.parametrize("activation", ["none", "gelu"])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_packed_linear_runs_on_the_engine_it_names_with_the_same_result(activation, n, tuning, monkeypatch):
    """Up to MKL_MAX_ROWS rows PackedLinear multiplies through MKL (F.linear on its plain weight); above,
    through the faster of MKL and the packed oneDNN product (timed once), or oneDNN with tuning off. Either
    way it computes the layer's function, and the profiler shows the engine it names."""
    monkeypatch.setenv("VITKIT_AUTOTUNE", "1" if tuning == "on" else "0")
    torch.manual_seed(0)
    linear = nn.Linear(48, 40)
    layer = PackedLinear(linear, activation, "tanh" if activation == "gelu" else "none")
    x, residual = torch.randn(1, n, 48), torch.randn(1, n, 40)
    ref = F.linear(x, linear.weight, linear.bias)
    ref = F.gelu(ref, approximate="tanh") if activation == "gelu" else ref
    with torch.inference_mode():
        engine = layer.engine(x)
        torch.testing.assert_close(layer(x), ref, rtol=0, atol=1e-5)
        if activation == "none":
            torch.testing.assert_close(layer.add(x, residual), ref + residual, rtol=0, atol=1e-5)
        ops = operators_called(lambda: layer(x), "")
    assert engine in ("plain", "packed")
    if n <= MKL_MAX_ROWS:
        assert engine == "plain"
    elif tuning == "off":
        assert engine == "packed"
    assert ("mkldnn::_linear_pointwise" in ops) is (engine == "packed")
    assert ("aten::linear" in ops) is (engine == "plain")


@pytest.mark.skipif(not onednn_packing_available(), reason=NO_PACKING)
@pytest.mark.parametrize("vendor,expected", [("GenuineIntel", "plain"), ("AuthenticAMD", "packed")])
def test_packed_linear_default_follows_the_inference_engine_rule(vendor, expected, monkeypatch):
    """With tuning off, a product of many rows takes MKL (the plain weight) on Intel CPUs, as the accelerated
    model's linear layers do, and the packed oneDNN product elsewhere."""
    monkeypatch.setenv("VITKIT_AUTOTUNE", "0")
    monkeypatch.setattr("vitkit.cpu.linear.cpu_vendor", lambda: vendor)
    layer = PackedLinear(nn.Linear(16, 8))
    assert layer.engine(torch.zeros(MKL_FROM_ROWS, 16)) == expected
    assert layer.engine(torch.zeros(MKL_FROM_ROWS - 1, 16)) == "packed"


def test_packed_linear_refuses_other_dtypes():
    if not onednn_packing_available():
        pytest.skip(NO_PACKING)
    layer = PackedLinear(nn.Linear(8, 4))
    with pytest.raises(ValueError, match="fp32"):
        layer(torch.randn(2, 8, dtype=torch.float64))


@pytest.mark.slow  # inductor compiles C++: about 20 s on 2 busy cores
def test_compile_computes_the_same_function():
    model = tiny_model(depth=1)
    fast = optimize(model, "fp32", compile=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), model(x), rtol=0, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 is for GPUs; no CUDA device here")
def test_bf16_on_cuda_is_close():
    model = tiny_model().cuda()
    fast = optimize(model, "bf16", compile=False)
    x = torch.randn(8, 3, 32, 32, device="cuda")
    with torch.inference_mode():
        out, ref = fast(x), model(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05)
