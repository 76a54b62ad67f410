"""vitkit's own int8 products for CPUs with AVX512-VNNI (csrc/int8_gemm.h): one layer and the whole int8
block, against the same quantisation written in PyTorch (each row of the input with its own symmetric 8-bit
scale, the weights per output channel), and the int8 model against fp32."""

import pytest
import torch
import torch.nn.functional as F

from operator_helpers import needs_operator
from test_kernels import int8_block_built
from test_optimize import tiny_model
from vitkit.cpu import build
from vitkit.cpu.int8 import (
    DynamicInt8Linear,
    bf16_tiles_apply,
    block_linears,
    block_on_vnni,
    int8_block,
    vnni_products,
)
from vitkit.inference import optimize


def vnni_built() -> bool:
    """vitkit's VNNI products, built: a CPU with AVX512-VNNI (else skipped) and the int8 block's library."""
    if not int8_block_built():
        return False
    if not build.int8_vnni_available():
        pytest.skip("vitkit's int8 products need a CPU with AVX512-VNNI")
    return True


needs_vnni = needs_operator(vnni_built, "int8 VNNI products")


def quantise_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x as integers in [-127, 127] and its scale max |x| / 127 (1 for a row of zeros)."""
    s = x.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(x * (1 / s)), s


def int_weight(layer: DynamicInt8Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's int8 weight (out, in) as integers and its per-output scales, from its fbgemm pack."""
    qweight, _ = torch.ops.quantized.linear_unpack(next(iter(layer.packs.values())))
    return qweight.int_repr().double(), layer.vnni[2].double()


def reference_linear(layer: DynamicInt8Linear, x: torch.Tensor) -> torch.Tensor:
    """What the layer computes, in fp64 from the same integers."""
    q, s = quantise_rows(x)
    w, sb = int_weight(layer)
    bias = layer.vnni[3].double() if layer.vnni[3].numel() else 0
    return ((q.double() @ w.T) * s.double() * sb + bias).float()


def reference_block(block, x: torch.Tensor, attention: str = "vitkit") -> torch.Tensor:
    """Eq. 2 and 3 with every product as reference_linear computes it, the attention on vitkit's fp32
    kernel, or with "vitkit-bf16" on its bf16 tiles from the projection rounded to bf16."""
    assert build.attention_available(), "the attention operator did not build (see the warning)"
    B, T, D = x.shape
    rows = x.reshape(B * T, D)
    qkv = reference_linear(block.attn.qkv, F.layer_norm(rows, (D,), block.norm1.weight, block.norm1.bias,
                                                         block.norm1.eps)).view(B, T, 3 * D)
    heads, scale = block.attn.num_heads, block.attn.scale
    if attention == "vitkit-bf16":
        y = torch.ops.vitkit.attention_forward_bf16(qkv.bfloat16().float(), heads, scale).reshape(B * T, D)
    else:
        y = torch.ops.vitkit.attention_forward(qkv, heads, scale, False)[0].reshape(B * T, D)
    x2 = reference_linear(block.attn.proj, y) + rows
    h = reference_linear(block.mlp.fc1, F.layer_norm(x2, (D,), block.norm2.weight, block.norm2.bias,
                                                      block.norm2.eps))
    h = F.gelu(h, approximate=block.mlp.act.approximate)
    return (reference_linear(block.mlp.fc2, h) + x2).view(B, T, D)


def close_but_for_a_rounding(out: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    """Equal to float rounding almost everywhere; where a value sits on an int8 rounding boundary the two
    sides may round it apart, one step of one row, which moves a few outputs by at most `atol`."""
    diff = (out - ref).abs()
    assert diff.max() <= atol, diff.max()
    assert (diff <= 1e-4 * (1 + ref.abs())).float().mean() >= 0.99


@needs_vnni
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("shape", [(64, 64), (22, 100), (130, 10), (256, 192)])  # (in, out)
def test_one_layer_computes_the_per_row_quantisation(rows, shape, threads):
    """Row counts around the 6-row tile, inner widths not a multiple of 4, outputs around the 64-column
    panel."""
    threads(2)
    torch.manual_seed(rows)
    linear = torch.nn.Linear(*shape)
    layer = DynamicInt8Linear(linear)
    assert layer.vnni is not None and "VNNI" in repr(layer)
    x = torch.randn(rows, shape[0]) * torch.rand(rows, 1) * 4  # rows of different ranges
    x[0] = 0  # a row of zeros
    with torch.inference_mode():
        out = layer(x)
        ref = reference_linear(layer, x)
        exact = linear(x)
    close_but_for_a_rounding(out, ref, atol=1e-2)
    assert (out - exact).abs().max() < 0.05 * exact.abs().max()
    assert out[0].allclose(linear.bias.detach(), atol=1e-6)


@needs_vnni
@pytest.mark.parametrize("attention", ["vitkit", "vitkit-bf16"])
@pytest.mark.parametrize("gelu", ["exact", "tanh"])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_block_on_vnni_products_computes_eq_2_and_3(attention, gelu, batch, threads):
    """With the attention in fp32, and in bf16 on the q;k;v projection the product writes in bf16."""
    if attention == "vitkit-bf16" and not bf16_tiles_apply(16):
        pytest.skip("vitkit's bf16 attention tiles need AVX512-BF16")
    threads(2)
    torch.manual_seed(batch)
    q = optimize(tiny_model(gelu=gelu), "int8")
    x = torch.randn(batch, 17, 64)
    for block in q.blocks:
        assert block.int8_kernel and block_on_vnni(block)
        with torch.inference_mode():
            out = int8_block(block, x, attention=attention)
            ref = reference_block(block, x, attention)
        close_but_for_a_rounding(out, ref, atol=2e-2)


@needs_vnni
@pytest.mark.parametrize("attention", ["vitkit", "vitkit-bf16"])
def test_a_nan_in_an_image_stays_in_that_image(attention):
    """A NaN token makes its image's outputs NaN through the attention (its projection's NaN kept when rounded
    to bf16), and leaves the other images as they are."""
    if attention == "vitkit-bf16" and not bf16_tiles_apply(16):
        pytest.skip("vitkit's bf16 attention tiles need AVX512-BF16")
    block = optimize(tiny_model(), "int8").blocks[0]
    x = torch.randn(3, 17, 64)
    with torch.inference_mode():
        clean = int8_block(block, x, attention=attention)
        x[1, 5, 7] = float("nan")
        out = int8_block(block, x, attention=attention)
    assert out[1].isnan().all()
    assert torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2])


@needs_vnni
@pytest.mark.parametrize("shares", [1, 2])
def test_odd_widths_and_several_mlp_blocks_a_share(shares, threads):
    """A width and hidden width off the vectors' 16 and the panels' 64 (68 and 136: LayerNorm's and the
    quantisation's tails, padded inner steps), and 153 rows, so that each share's MLP runs in several
    blocks of rows."""
    threads(2)
    torch.manual_seed(shares)
    q = optimize(tiny_model(dim=68, num_heads=4, mlp_dim=136), "int8")
    x = torch.randn(9, 17, 68)
    for block in q.blocks:
        assert block_on_vnni(block)
        with torch.inference_mode():
            out = int8_block(block, x, shares, attention="vitkit")
            ref = reference_block(block, x)
        close_but_for_a_rounding(out, ref, atol=2e-2)


@needs_vnni
def test_a_nan_in_a_row_comes_out_as_nan_in_that_row():
    """As in fp32: a NaN is not lost in the row's scale (vmaxps would drop it); the other rows keep
    theirs."""
    layer = DynamicInt8Linear(torch.nn.Linear(40, 70))
    x = torch.randn(8, 40)
    x[3, 17] = float("nan")
    with torch.inference_mode():
        out = layer(x)
    assert out[3].isnan().all()
    assert torch.isfinite(torch.cat([out[:3], out[4:]])).all()


@needs_vnni
@pytest.mark.parametrize("attention", ["vitkit", "sdpa", "sdpa-bf16", "vitkit-bf16"])
def test_the_cut_into_shares_leaves_the_numbers_as_they_are(attention, threads):
    """Each token is quantised on its own: one share, two or three, one thread or two, the same bits."""
    if attention == "vitkit-bf16" and not bf16_tiles_apply(16):
        pytest.skip("vitkit-bf16 attention needs AVX512-BF16")
    q = optimize(tiny_model(num_heads=4), "int8")
    x = torch.randn(2, 17, 64)
    block = q.blocks[0]
    with torch.inference_mode():
        results = []
        for n_threads, shares in ((1, 1), (2, 2), (2, 3), (1, 3)):
            threads(n_threads)
            results.append(int8_block(block, x, shares, attention))
    for r in results[1:]:
        assert torch.equal(r, results[0])


@needs_vnni
def test_the_int8_model_stays_close_to_fp32(threads):
    threads(2)
    model = tiny_model()
    q = optimize(model, "int8")
    assert all(block_on_vnni(b) for b in q.blocks)
    x = torch.randn(16, 3, 32, 32)
    with torch.inference_mode():
        ref, out = model(x), q(x)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.05, rel


@needs_vnni
def test_the_operators_refuse_what_does_not_fit():
    layer = DynamicInt8Linear(torch.nn.Linear(32, 48))
    packed, colsum, scale, bias = layer.vnni
    with pytest.raises(RuntimeError, match=r"packed weight \[64, 32\] does not match 48 outputs x 36 inputs"):
        torch.ops.vitkit.int8_vnni_linear(torch.randn(2, 36), packed, colsum, scale, bias)
    with pytest.raises(ValueError, match="in_features=32, .*got inputs of 31 features"):
        layer(torch.randn(2, 31))  # 31 and 32 pad alike: the layer itself checks
    with pytest.raises(RuntimeError, match="the bias has 5 values for 48 outputs"):
        torch.ops.vitkit.int8_vnni_linear(torch.randn(2, 32), packed, colsum, scale, torch.randn(5))
    with pytest.raises(RuntimeError, match=r"sums \(48, int32\) and scales \(47, fp32\) must be as many"):
        torch.ops.vitkit.int8_vnni_linear(torch.randn(2, 32), packed, colsum, scale[:47], bias[:47])
    with pytest.raises(RuntimeError, match="expected an int8 weight"):
        torch.ops.vitkit.int8_vnni_pack(torch.randn(4, 4))
    block = optimize(tiny_model(), "int8").blocks[0]
    with pytest.raises(RuntimeError, match="gelu_approximate must be none or tanh"):
        operands = list(zip(*(lin.vnni for lin in block_linears(block)), strict=True))
        torch.ops.vitkit.int8_block_vnni(torch.randn(1, 17, 64), block.norm1.weight, block.norm1.bias, 1e-6,
                                         block.norm2.weight, block.norm2.bias, 1e-6, *operands, 4, 0.25,
                                         "vitkit", "erf", 1)


def test_amx_cpus_keep_onednn_and_7_bit_activations_keep_fbgemm(monkeypatch):
    """The rule of `vnni_products`: no AMX (whose tile products are oneDNN's), and 8-bit activations only."""
    from vitkit.cpu import int8

    monkeypatch.setattr(int8, "cpu_flags", lambda: frozenset({"amx_int8"}))
    assert not vnni_products()
    monkeypatch.setattr(int8, "cpu_flags", lambda: frozenset())
    monkeypatch.setattr(int8, "int8_vnni_available", lambda: True)
    assert vnni_products()
    if not build.int8_block_available():
        return
    monkeypatch.setattr(int8, "int8_vnni_available", build.int8_vnni_available)
    assert DynamicInt8Linear(torch.nn.Linear(8, 8), reduce_range=True).vnni is None
