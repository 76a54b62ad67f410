"""The bf16 block operator for CPUs with AVX512-BF16 (csrc/bf16_block.cpp, csrc/bf16_gemm.h): the block
against the bf16 layers it replaces and against eq. 2 and 3 in float64, the bf16 model on it, where it gives
way, and its refusals (what it shares with the fp32 operator: tests/test_block_operators.py)."""

import pytest
import torch
import torch.nn as nn

from operator_helpers import needs_operator, operators_called
from test_fp32_block import reference
from test_optimize import tiny_model
from vitkit.cpu import autotune, build
from vitkit.cpu import fused_block as fused_block_module
from vitkit.cpu.bf16_block import bf16_block
from vitkit.cpu.hardware import cpu_flags, cpu_isa
from vitkit.cpu.private import onednn_packing_available
from vitkit.inference import optimize


def bf16_block_built() -> bool:
    """The operator, built: a CPU with AVX512-BF16 where oneDNN packs weights (else skipped), and the
    library."""
    if cpu_isa() != "avx512" or "avx512_bf16" not in cpu_flags():
        pytest.skip("the bf16 block operator needs a CPU with AVX512-BF16")
    if not onednn_packing_available():
        pytest.skip("this PyTorch cannot pack oneDNN weights: no PackedLinear to build the blocks from")
    return build.bf16_block_available()


needs_bf16_block = needs_operator(bf16_block_built, "bf16 block")


def blocks_of(gelu: str, **overrides) -> list[nn.Module]:
    model = tiny_model(**overrides)
    for block in model.blocks:
        block.mlp.act = nn.GELU(approximate=gelu)
    blocks = list(optimize(model, "bf16").blocks)
    assert all(b.bf16_operands is not None for b in blocks)
    return blocks


@needs_bf16_block
@pytest.mark.parametrize("gelu", ["none", "tanh"])
@pytest.mark.parametrize("batch,dim,heads,mlp,qkv_bias", [(2, 64, 4, 128, True), (1, 192, 3, 768, True),
                                                          (3, 128, 2, 256, False), (2, 256, 2, 128, True)])
def test_the_block_computes_what_its_bf16_layers_compute(gelu, batch, dim, heads, mlp, qkv_bias, threads):
    """Odd token counts (17 patches and a class token), heads of 16 to 128 dims, exact and tanh GELU, a q;k;v
    layer without bias: within bf16 rounding of the layers it replaces (which may round where it does not,
    on their plain products), and at least as close as they are to the float64 block."""
    threads(2)
    torch.manual_seed(dim + heads)
    block = blocks_of(gelu, dim=dim, num_heads=heads, mlp_dim=mlp, qkv_bias=qkv_bias)[0]
    assert (block.attn.qkv.bias is None) == (not qkv_bias)
    x = torch.randn(batch, 17, dim).bfloat16()
    with torch.inference_mode():
        out, layers = bf16_block(block, x), block.forward_layers(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    torch.testing.assert_close(out.float(), layers.float(), rtol=2e-2, atol=2e-2 * layers.abs().max().item())
    want = reference(block, x)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=3e-2 * want.abs().max().item())
    assert (out.double() - want).norm() <= 1.25 * (layers.double() - want).norm()


@needs_bf16_block
def test_the_bf16_model_runs_its_blocks_on_the_operator(monkeypatch, threads):
    """optimize(model, "bf16") with AVX512-BF16: every block readied, the operator called for the blocks that
    compute every token (the class-token shortcut's last block keeps its layers), the logits within bf16
    rounding of the fp32 model's; with the operator timed slower, the layers, nearly the same logits."""
    monkeypatch.setenv(autotune.ENV, "0")  # the operator by default: no timing run among the calls counted
    threads(2)
    model = tiny_model()
    fast = optimize(model, "bf16")
    assert all(b.bf16_operands is not None for b in fast.blocks)
    x = torch.randn(3, 3, 32, 32)
    with torch.inference_mode():
        called = operators_called(lambda: fast(x), "vitkit::bf16_block")
        out, ref = fast(x), model(x)
    assert called == {"vitkit::bf16_block"}
    scale = ref.abs().max().item()
    torch.testing.assert_close(out, ref, rtol=0, atol=5e-2 * scale)
    monkeypatch.setattr(fused_block_module, "bf16_block_chosen", lambda block, x: False)
    with torch.inference_mode():
        assert operators_called(lambda: fast(x), "vitkit::bf16_block") == set()
        torch.testing.assert_close(fast(x), out, rtol=0, atol=2e-2 * scale)


@needs_bf16_block
def test_blocks_the_operator_does_not_compute_keep_their_layers():
    """Heads of 8 dims (the bf16 tiles take 16 to 128) and widths not in panels of 64: not readied; a block
    readied runs its layers when asked for attention maps, under autocast, or with a hook on a layer the
    operator would skip."""
    assert all(b.bf16_operands is None for b in optimize(tiny_model(num_heads=8), "bf16").blocks)
    assert all(b.bf16_operands is None for b in optimize(tiny_model(mlp_dim=96), "bf16").blocks)
    fast = optimize(tiny_model(), "bf16")
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        assert operators_called(lambda: fast.forward_features(x, return_attention=True),
                                "vitkit::bf16_block") == set()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not fused_block_module.bf16_block_chosen(fast.blocks[0], torch.randn(2, 17, 64).bfloat16())
    tokens = torch.randn(2, 17, 64).bfloat16().requires_grad_()
    assert not fused_block_module.bf16_block_chosen(fast.blocks[0], tokens)  # gradients wanted
    seen = []  # a hook on a layer the operator would skip: the block runs its layers, and the hook fires
    handle = fast.blocks[0].mlp.fc1.register_forward_hook(lambda *args: seen.append(1))
    with torch.inference_mode():
        assert not fused_block_module.bf16_block_chosen(fast.blocks[0], torch.randn(2, 17, 64).bfloat16())
        fast(x)
    handle.remove()
    assert seen == [1]


@needs_bf16_block
def test_the_model_under_autocast_and_strided_tokens(threads):
    """A bf16 model called under CPU autocast runs as without it; tokens that are not contiguous give what
    their contiguous copy gives."""
    threads(2)
    fast = optimize(tiny_model(), "bf16")
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        want = fast(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.testing.assert_close(fast(x), want, rtol=0, atol=0)
        tokens = torch.randn(2, 64, 17).bfloat16().transpose(1, 2)
        block = fast.blocks[0]
        assert torch.equal(bf16_block(block, tokens), bf16_block(block, tokens.contiguous()))


@needs_bf16_block
def test_the_operators_refuse_what_does_not_fit():
    with pytest.raises(RuntimeError, match="out a multiple of 64 and in even"):
        torch.ops.vitkit.bf16_block_pack(torch.randn(96, 32).bfloat16())
    with pytest.raises(RuntimeError, match="out a multiple of 64 and in even"):
        torch.ops.vitkit.bf16_block_pack(torch.randn(64, 33).bfloat16())
    block = blocks_of("none")[0]
    packed, biases, norms = block.bf16_operands
    x, eps = torch.randn(1, 5, 64).bfloat16(), block.norm1.eps
    args = (norms[0], norms[1], eps, norms[2], norms[3], eps)
    with pytest.raises(RuntimeError, match="four of each"):
        torch.ops.vitkit.bf16_block(x, *args, packed[:3], biases, 4, 0.25, "none", 2)
    with pytest.raises(RuntimeError, match="not a packed weight of 64 inputs"):
        torch.ops.vitkit.bf16_block(x, *args, [packed[3], *packed[1:]], biases, 4, 0.25, "none", 2)
    with pytest.raises(RuntimeError, match="gelu_approximate"):
        torch.ops.vitkit.bf16_block(x, *args, packed, biases, 4, 0.25, "sigmoid", 2)
    with pytest.raises(RuntimeError, match="bias has 3 values"):
        torch.ops.vitkit.bf16_block(x, *args, packed, [torch.randn(3), *biases[1:]], 4, 0.25, "none", 2)
    with pytest.raises(RuntimeError, match="heads of 16 to 128"):
        torch.ops.vitkit.bf16_block(x, *args, packed, biases, 8, 0.25, "none", 2)
    with pytest.raises(RuntimeError, match="expected bf16 tokens"):
        torch.ops.vitkit.bf16_block(x.float(), *args, packed, biases, 4, 0.25, "none", 2)
    shifted = torch.empty(packed[0].numel() + 32, dtype=torch.bfloat16)[1:1 + packed[0].numel()]
    with pytest.raises(RuntimeError, match="not 64-byte aligned"):
        torch.ops.vitkit.bf16_block(x, *args, [shifted.view(packed[0].shape), *packed[1:]], biases, 4, 0.25,
                                    "none", 2)
    with pytest.raises(RuntimeError, match="LayerNorms' weights"):
        torch.ops.vitkit.bf16_block(x, *(a.bfloat16() if isinstance(a, torch.Tensor) else a for a in args),
                                    packed, biases, 4, 0.25, "none", 2)
