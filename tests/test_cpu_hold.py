"""VITKIT_CPU_ISA=avx2: vitkit held to AVX2 on any CPU (vitkit.cpu.hardware, csrc/cpu_hold.h), the proxy for
an AVX2-only CPU's paths. The flags lose AVX-512 and AMX, a bad value is an error naming the variable, and a
process held to AVX2 builds its own operators, runs no AVX-512 tiles and trains a model to the same loss and
gradients as PyTorch's modules."""

import pytest
import torch

from operator_helpers import operator_skip_reason
from process_helpers import in_child
from vitkit.cpu import hardware
from vitkit.cpu.hardware import HOLD_ENV, held_flags, isa_hold

ZEN4 = frozenset({"sse2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"})
SPR = ZEN4 | {"amx_tile", "amx_int8", "amx_bf16", "avx_vnni"}


def test_held_to_avx2_the_flags_lose_avx512_and_amx():
    assert held_flags(ZEN4, "avx2") == {"sse2", "avx", "avx2", "fma"}
    assert held_flags(SPR, "avx2") == {"sse2", "avx", "avx2", "fma", "avx_vnni"}
    assert held_flags(SPR, "") == SPR


@pytest.mark.parametrize("value, hold", [("", ""), ("avx2", "avx2"), (" AVX2 ", "avx2")])
def test_the_hold_is_read_from_the_environment(monkeypatch, value, hold):
    monkeypatch.setenv(HOLD_ENV, value)
    assert isa_hold() == hold
    monkeypatch.delenv(HOLD_ENV)
    assert isa_hold() == ""


def test_an_unknown_hold_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(HOLD_ENV, "sse4")
    with pytest.raises(ValueError, match=r"VITKIT_CPU_ISA='sse4'.*avx2"):
        isa_hold()


def held_process_trains_as_pytorch() -> None:
    """In a process started with VITKIT_CPU_ISA=avx2: the CPU reads as AVX2, the AVX-512-only operators are
    unavailable, the fp32 block runs on its AVX2 products, the attention's register tiles serve no width, its
    softmax rows take 8 floats at a time, the attention on sgemm and those rows (and their tails, and terms
    that underflow) equals the explicit formula in float64, and an accelerated model's training step equals
    PyTorch's to float rounding."""
    import torch.nn.functional as F

    import vitkit
    from test_qkv_attention import test_attention_and_gradient_equal_the_explicit_formula as against_float64
    from test_qkv_attention import test_the_operators_softmax_underflows_to_zero as underflow
    from vitkit.cpu import build
    from vitkit.cpu.private import onednn_packing_available

    real = held_flags(frozenset(hardware._cpuinfo_field("flags").split()), "")
    assert hardware.cpu_isa() == ("avx2" if "avx2" in real else "")
    assert not any(f.startswith(("avx512", "amx")) for f in hardware.cpu_flags())
    assert not build.bf16_block_available()
    # the fp32 block runs on its AVX2 products: panels of 16 columns, eq. 2 and 3 as in float64
    assert build.fp32_block_available() == ({"avx2", "fma"} <= real and torch.backends.openmp.is_available())
    if build.fp32_block_available() and onednn_packing_available():
        from test_fp32_block import test_the_block_computes_eq_2_and_3 as block_against_float64

        assert torch.ops.vitkit.fp32_block_pack(torch.randn(128, 32)).shape == (8, 32, 16)
        for gelu in ("none", "tanh"):
            block_against_float64(gelu, 2, 64, 4, 128, True, torch.set_num_threads)
            block_against_float64(gelu, 1, 192, 3, 768, False, torch.set_num_threads)
    assert build.attention_available(), "the attention operators did not build held to AVX2"
    assert not any(torch.ops.vitkit.attention_tiles_apply(w) for w in (16, 32, 64, 128))
    assert torch.ops.vitkit.attention_row_width() == (8 if {"avx2", "fma"} <= real else 4)
    for B, T, heads, Dh in [(2, 197, 6, 64), (1, 50, 4, 16), (3, 17, 2, 24), (2, 1, 1, 16)]:
        for keep_probs in (True, False):
            against_float64(B, T, heads, Dh, keep_probs, tiles=True)
    underflow(tiles=True)

    torch.manual_seed(0)
    cfg = vitkit.get_config("ViT-Ti/16").replace(image_size=32, patch_size=8, num_classes=10, depth=2)
    plain = vitkit.VisionTransformer(cfg)
    fast = vitkit.accelerate(vitkit.VisionTransformer(cfg))
    fast.load_state_dict(plain.state_dict())
    x, y = torch.randn(4, 3, 32, 32), torch.arange(4)
    grads = []
    for model in (plain, fast):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-5)
    for g, r in zip(grads[1][1], grads[0][1], strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_a_process_held_to_avx2_runs_no_avx512_operator(monkeypatch):
    reason = operator_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    if "avx2" not in hardware._cpuinfo_field("flags").split():
        pytest.skip("this CPU has no AVX2 to be held to")
    monkeypatch.setenv(HOLD_ENV, "avx2")
    in_child(__file__, "held_process_trains_as_pytorch()")
