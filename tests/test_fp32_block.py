"""The fp32 block operator for AVX-512 and AVX2 CPUs (csrc/fp32_block.cpp, csrc/fp32_gemm.h,
csrc/fp32_gemm_avx2.h): the block against eq. 2 and 3 in float64, the fp32 model on it, where it gives way,
and its refusals (what it shares with the bf16 operator: tests/test_block_operators.py)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from operator_helpers import needs_operator, operators_called
from test_optimize import tiny_model
from vitkit.attention import merge_heads, split_heads
from vitkit.cpu import autotune, build
from vitkit.cpu import fp32_block as fp32_block_module
from vitkit.cpu import fused_block as fused_block_module
from vitkit.cpu.convert import fp32_block_operators, fuse_blocks, pack_linears
from vitkit.cpu.fp32_block import fp32_block, fp32_block_eligible
from vitkit.cpu.fused_block import FusedBlock
from vitkit.cpu.hardware import cpu_isa
from vitkit.cpu.int8 import block_linears
from vitkit.cpu.private import onednn_packing_available
from vitkit.inference import optimize


def fp32_block_built() -> bool:
    """The operator, built: an AVX-512 or AVX2 CPU where oneDNN packs weights (else skipped) and the
    library."""
    if cpu_isa() not in ("avx512", "avx2"):
        pytest.skip("the fp32 block operator needs an AVX-512 or AVX2 CPU")
    if not onednn_packing_available():
        pytest.skip("this PyTorch cannot pack oneDNN weights: no PackedLinear to build the blocks from")
    return build.fp32_block_available()


needs_fp32_block = needs_operator(fp32_block_built, "fp32 block")


def reference(block, x: torch.Tensor) -> torch.Tensor:
    """Eq. 2 and 3 in float64 from the block's own weights."""
    x = x.double()
    qkv, proj, fc1, fc2 = ((lin.plain_weight.double(), None if lin.bias is None else lin.bias.double())
                           for lin in block_linears(block))
    n1, n2 = block.norm1, block.norm2
    h = F.layer_norm(x, n1.normalized_shape, n1.weight.double(), n1.bias.double(), n1.eps)
    q, k, v = split_heads(F.linear(h, *qkv), block.attn.num_heads)
    y = merge_heads(torch.softmax(q @ k.transpose(-1, -2) * block.attn.scale, -1) @ v)
    x = x + F.linear(y, *proj)
    h = F.layer_norm(x, n2.normalized_shape, n2.weight.double(), n2.bias.double(), n2.eps)
    return x + F.linear(F.gelu(F.linear(h, *fc1), approximate=block.mlp.fc1.approximate), *fc2)


def blocks_of(gelu: str, **overrides) -> list[FusedBlock]:
    model = tiny_model(**overrides)
    for block in model.blocks:
        block.mlp.act = nn.GELU(approximate=gelu)
    fast = fp32_block_operators(pack_linears(fuse_blocks(model)))
    blocks = list(fast.blocks)
    assert all(b.fp32_operands is not None for b in blocks)
    return blocks


@needs_fp32_block
@pytest.mark.parametrize("gelu", ["none", "tanh"])
@pytest.mark.parametrize("batch,dim,heads,mlp,qkv_bias", [(2, 64, 4, 128, True), (1, 192, 3, 768, True),
                                                          (3, 128, 8, 256, False), (2, 64, 8, 128, True),
                                                          (1, 448, 7, 512, True), (1, 64, 4, 1600, True)])
def test_the_block_computes_eq_2_and_3(gelu, batch, dim, heads, mlp, qkv_bias, threads):
    """Odd token counts (17 patches and a class token), heads of 16 to 64 (the attention's register tiles)
    and of 8 (its sgemm path, inside the region), exact and tanh GELU, a q;k;v layer without bias, inner
    dimensions past the AVX2 products' step of 384 (fc2's from 512, every layer's at width 448, fc2's 1600 in
    five steps: the residual and GELU applied once, on the last step): within float rounding of the float64
    block."""
    threads(2)
    block = blocks_of(gelu, dim=dim, num_heads=heads, mlp_dim=mlp, qkv_bias=qkv_bias)[0]
    assert (block.attn.qkv.bias is None) == (not qkv_bias)
    x = torch.randn(batch, 17, dim)
    with torch.inference_mode():
        out = fp32_block(block, x)
    want = reference(block, x)
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5 * want.abs().max().item())


@needs_fp32_block
def test_the_fp32_model_runs_its_blocks_on_the_operator(monkeypatch, threads):
    """optimize(model) on an AVX-512 or AVX2 CPU: every block readied, the operator called for the blocks that
    compute every token (the class-token shortcut's last block keeps its layers), the logits within 1e-5 of
    the model's; with the operator timed slower, the layers, the same logits to float rounding."""
    monkeypatch.setenv(autotune.ENV, "0")  # no timing run among the calls counted; the operator by default
    monkeypatch.setattr(fp32_block_module, "fp32_block_default", lambda: "operator")
    threads(2)
    model = tiny_model()
    fast = optimize(model)
    assert all(b.fp32_operands is not None for b in fast.blocks)
    x = torch.randn(3, 3, 32, 32)
    with torch.inference_mode():
        called = operators_called(lambda: fast(x), "vitkit::fp32_block")
        out, ref = fast(x), model(x)
    assert called == {"vitkit::fp32_block"}
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    monkeypatch.setattr(fused_block_module, "fp32_block_chosen", lambda block, x: False)
    with torch.inference_mode():
        assert operators_called(lambda: fast(x), "vitkit::fp32_block") == set()
        torch.testing.assert_close(fast(x), out, rtol=0, atol=1e-6 * ref.abs().max().item())


@needs_fp32_block
def test_blocks_the_operator_does_not_compute_keep_their_layers():
    """Widths not in panels of 64: not eligible; a block readied runs its layers when asked for attention
    maps, or with a hook on a layer the operator would skip."""
    assert not any(fp32_block_eligible(b) for b in pack_linears(fuse_blocks(tiny_model(dim=48, num_heads=3))
                                                                 ).blocks)
    model = fp32_block_operators(pack_linears(fuse_blocks(tiny_model(mlp_dim=96))))
    assert all(b.fp32_operands is None for b in model.blocks)  # fc1's 96 outputs: not panels of 64
    fast = optimize(tiny_model())
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        assert operators_called(lambda: fast.forward_features(x, return_attention=True),
                                "vitkit::fp32_block") == set()
    seen = []  # a hook on a layer the operator would skip: the block runs its layers, and the hook fires
    handle = fast.blocks[0].mlp.fc1.register_forward_hook(lambda *args: seen.append(1))
    with torch.inference_mode():
        assert not fused_block_module.fp32_block_chosen(fast.blocks[0], torch.randn(2, 17, 64))
        fast(x)
    handle.remove()
    assert seen == [1]


@needs_fp32_block
def test_the_operators_refuse_what_does_not_fit():
    with pytest.raises(RuntimeError, match="out a multiple of 64"):
        torch.ops.vitkit.fp32_block_pack(torch.randn(96, 32))
    block = blocks_of("none")[0]
    packed, biases = block.fp32_operands
    x, n = torch.randn(1, 5, 64), block.norm1
    args = (n.weight, n.bias, n.eps, n.weight, n.bias, n.eps)
    with pytest.raises(RuntimeError, match="four of each"):
        torch.ops.vitkit.fp32_block(x, *args, packed[:3], biases, 4, 0.25, "none", 2)
    with pytest.raises(RuntimeError, match="not a packed weight of 64 inputs"):
        torch.ops.vitkit.fp32_block(x, *args, [packed[3], *packed[1:]], biases, 4, 0.25, "none", 2)
    with pytest.raises(RuntimeError, match="gelu_approximate"):
        torch.ops.vitkit.fp32_block(x, *args, packed, biases, 4, 0.25, "sigmoid", 2)
    with pytest.raises(RuntimeError, match="bias has 3 values"):
        torch.ops.vitkit.fp32_block(x, *args, packed, [torch.randn(3), *biases[1:]], 4, 0.25, "none", 2)
    with pytest.raises(RuntimeError, match="expected fp32 tokens"):
        torch.ops.vitkit.fp32_block(x.double(), *args, packed, biases, 4, 0.25, "none", 2)
