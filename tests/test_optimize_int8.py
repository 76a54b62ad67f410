"""vitkit.optimize(model, "int8"): what it quantises, how its products quantise, and how close it stays to
fp32 (>= 99 % top-1 agreement on a trained model); the int8 model's bf16 attention."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import vitkit
import vitkit.attention
import vitkit.cpu.convert as convert_module
import vitkit.cpu.int8 as int8_module
from test_optimize import tiny_model
from vitkit.cpu.fused_block import FusedBlock
from vitkit.cpu.hardware import cpu_has_native_bf16, cpu_has_vnni
from vitkit.cpu.int8 import DynamicInt8Linear, GELUInPlace, bf16_attention
from vitkit.inference import optimize


@pytest.fixture
def one_thread():
    """Tiny models train faster on one thread than on two busy ones; the setting is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def trained_tiny_model(steps: int = 40):
    """A tiny ViT trained for a few seconds to tell 4 noisy templates apart, and a sampler of that task.

    A model with random weights makes no decisions worth keeping: it predicts nearly the same class for
    every input, or, with a head centred on its features, separates inputs by margins that any rounding
    flips. Agreement is only meaningful for a model that has learned something.
    """
    cfg = vitkit.ViTConfig(image_size=16, patch_size=4, dim=32, depth=2, num_heads=2, mlp_dim=64,
                           num_classes=4)
    templates = torch.randn(4, 3, 16, 16)

    def sample(n: int):
        y = torch.randint(0, 4, (n,))
        return templates[y] + 1.5 * torch.randn(n, 3, 16, 16), y

    model = vitkit.create_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        x, y = sample(32)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), sample


def test_int8_agrees_with_fp32_on_a_trained_model(one_thread):
    model, sample = trained_tiny_model()
    q = optimize(model, "int8")
    x, y = sample(1024)
    with torch.inference_mode():
        ref, out = model(x), q(x)
    assert (ref.argmax(-1) == y).float().mean() > 0.9  # it has learned the task
    agreement = (ref.argmax(-1) == out.argmax(-1)).float().mean().item()
    assert agreement >= 0.99, f"int8 top-1 agreement {agreement:.4f} < 0.99"


@pytest.mark.parametrize("own_products", [True, False])
def test_int8_quantises_the_encoder_and_with_per_row_scales_the_patch_projection(own_products, monkeypatch):
    """The encoder's layers always; the patch projection where vitkit's own products (one scale a patch) run;
    the classifier never."""
    own_products = own_products and int8_module.vnni_products()
    monkeypatch.setattr(convert_module, "vnni_products", lambda: own_products)
    model = tiny_model()
    q = optimize(model, "int8")
    # qkv, proj, fc1, fc2, and the last block's query projection of the class token alone
    assert sum(isinstance(m, DynamicInt8Linear) for m in q.modules()) == 4 * len(q.blocks) + 1 + own_products
    assert isinstance(q.patch_embed.proj, DynamicInt8Linear) == own_products
    assert not isinstance(q.head, DynamicInt8Linear)  # the classifier stays fp32
    x = torch.randn(64, 3, 32, 32)
    with torch.inference_mode():
        ref, out = model(x), q(x)
    # Close, but not equal: it really is quantised.
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.05, rel


def test_int8_linear_matches_a_reference_quantisation():
    """DynamicInt8Linear against the arithmetic written out: per-channel symmetric int8 weights, per-tensor
    asymmetric uint8 activations, int32 products, rescaled; 8-bit or 7-bit activations."""
    layer = nn.Linear(64, 24)
    x = torch.randn(5, 64) * 3
    for reduce_range in (False, True) if cpu_has_vnni() else (True,):  # 8 bits need VNNI (next test)
        q = DynamicInt8Linear(layer, reduce_range=reduce_range)
        q.vnni = None  # fbgemm's arithmetic (vitkit's own VNNI products: tests/test_int8_vnni.py)
        levels = 127 if reduce_range else 255
        lo, hi = min(x.min().item(), 0.0), max(x.max().item(), 0.0)
        sx = (hi - lo) / levels
        zx = round(-lo / sx)
        xq = torch.clamp(torch.round(x / sx) + zx, 0, levels)
        sw = layer.weight.abs().amax(dim=1) / 127
        wq = torch.round(layer.weight / sw[:, None])
        expected = ((xq - zx) @ wq.T) * sx * sw + layer.bias
        with torch.no_grad():
            torch.testing.assert_close(q(x), expected, rtol=0, atol=2e-3 * expected.abs().max().item())
            # and it is close to the float layer
            assert (q(x) - layer(x)).abs().max() < 0.05 * layer(x).abs().max()


@pytest.mark.parametrize("flags,expected", [
    ({"avx2"}, ("fbgemm",)),
    ({"avx512f", "avx512_vnni"}, ("fbgemm", "onednn")),
    ({"avx512f", "avx512_vnni", "amx_int8"}, ("onednn", "fbgemm")),
])
def test_int8_engines_follow_the_cpu(flags, expected, monkeypatch):
    """oneDNN joins fbgemm only on CPUs with VNNI (and where this torch has it), and leads where there is
    AMX."""
    monkeypatch.setattr(int8_module, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(int8_module, "cpu_has_vnni", lambda: bool(flags & {"avx512_vnni", "amx_int8"}))
    if "onednn" not in torch.backends.quantized.supported_engines:
        expected = ("fbgemm",)
    assert int8_module.int8_engines() == expected


@pytest.mark.parametrize("tuning", ["on", "off"])
def test_int8_linear_engines_compute_the_same_quantisation(tuning, monkeypatch):
    """Each engine's packed weights give the layer's quantised function (to float rounding), whichever the
    timing picks for a row count; with tuning off the layer packs the default engine only. The global
    quantized engine is left as it was."""
    monkeypatch.setenv("VITKIT_AUTOTUNE", "1" if tuning == "on" else "0")
    torch.manual_seed(0)
    layer = nn.Linear(64, 40)
    before = torch.backends.quantized.engine
    q = DynamicInt8Linear(layer)
    q.vnni = None  # the engines' products (vitkit's own VNNI products: tests/test_int8_vnni.py)
    assert torch.backends.quantized.engine == before
    engines = int8_module.int8_engines()
    assert tuple(q.packs) == (engines if tuning == "on" else engines[:1])
    x = torch.randn(3, 7, 64) * 2
    with torch.no_grad():
        outs = {e: torch.ops.quantized.linear_dynamic(x, p, reduce_range=q.reduce_range)
                for e, p in q.packs.items()}
        first = next(iter(outs.values()))
        for out in outs.values():
            torch.testing.assert_close(out, first, rtol=0, atol=1e-5 * first.abs().max().item())
        chosen = q.packed(21)
        assert any(chosen is p for p in q.packs.values())
        torch.testing.assert_close(q(x), first, rtol=0, atol=1e-5 * first.abs().max().item())


def test_int8_linear_picks_7_bit_activations_without_vnni_and_refuses_8(monkeypatch):
    layer = nn.Linear(64, 24)
    monkeypatch.setattr(int8_module, "cpu_has_vnni", lambda: False)
    assert DynamicInt8Linear(layer).reduce_range is True
    with pytest.raises(ValueError, match="reduce_range=False .* VNNI"):
        DynamicInt8Linear(layer, reduce_range=False)
    monkeypatch.setattr(int8_module, "cpu_has_vnni", lambda: True)
    assert DynamicInt8Linear(layer).reduce_range is False


@pytest.mark.parametrize("queries", [None, 1])
def test_bf16_attention_is_close_to_fp32_attention(queries):
    torch.manual_seed(0)
    B, T, H, D = 3, 17, 4, 64
    qkv = torch.randn(B, T, 3 * D)
    q, k, v = vitkit.attention.split_heads(qkv, H)
    ref = vitkit.attention.merge_heads(
        F.scaled_dot_product_attention(q if queries is None else q[:, :, :queries], k, v))
    out = bf16_attention(qkv, H, (D // H) ** -0.5, queries)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert ((out - ref).norm() / ref.norm()).item() < 2e-2  # bf16's 8-bit mantissa, not 1e-4
    assert (out - ref).abs().max() > 0  # really computed in bf16


def test_int8_model_parts():
    q = optimize(tiny_model(), "int8")
    assert all(isinstance(b.mlp.act, GELUInPlace) for b in q.blocks)
    assert all(isinstance(b, FusedBlock) for b in q.blocks)
    assert all((b.attention_dtype == torch.bfloat16) == cpu_has_native_bf16() for b in q.blocks)
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        feats, attns = q.forward_features(x, return_attention=True)
    assert len(attns) == len(q.blocks) and attns[0].shape == (2, 4, 17, 17)
