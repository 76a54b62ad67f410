"""vitkit's bf16 LayerNorm (vitkit.cpu.bf16_norm): against PyTorch's bf16 LayerNorm and float64, where it runs
and where it gives way, and in a bf16 model from optimize."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import vitkit
from operator_helpers import needs_operator, operators_called
from vitkit.cpu.bf16_norm import Bf16LayerNorm, bf16_layer_norms
from vitkit.cpu.build import layer_norm_bf16_available
from vitkit.cpu.hardware import cpu_flags
from vitkit.cpu.packed import PackedLinear


def needs_kernel(test):
    """Skipped on CPUs without AVX512-BF16 or where the operators cannot be built (failed where they should
    have been and were not)."""
    test = needs_operator(layer_norm_bf16_available, "layer_norm_bf16")(test)
    return pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="this CPU has no AVX512-BF16")(test)


def norm(width: int, seed: int = 0) -> nn.LayerNorm:
    torch.manual_seed(seed)
    ln = nn.LayerNorm(width, eps=1e-6).bfloat16()
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    return ln


@needs_kernel
@pytest.mark.parametrize("shape", [(2, 197, 384), (3, 17), (1, 5, 100), (4, 1, 16), (2, 3, 1280)])
def test_the_kernel_is_torchs_bf16_layer_norm_to_one_rounding(shape, threads):
    """Widths with and without a tail of 16: every output within one bf16 step of PyTorch's bf16 LayerNorm
    (both compute in fp32; the sums' last bits may round an output the other way), nearly all equal, and no
    farther from the float64 LayerNorm of the same bf16 input than PyTorch's is, to a bf16 step."""
    threads(2)
    ln = norm(shape[-1])
    x = (torch.randn(shape) * 3 + 1).bfloat16()
    with torch.inference_mode():
        ours = torch.ops.vitkit.layer_norm_bf16(x, ln.weight, ln.bias, ln.eps)
        theirs = ln(x)
    exact = F.layer_norm(x.double(), shape[-1:], ln.weight.double(), ln.bias.double(), ln.eps)
    step = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)  # one bf16 step at each value
    assert ours.dtype == torch.bfloat16 and ours.shape == x.shape
    assert ((ours.double() - theirs.double()).abs() <= step * 1.01).all()
    assert (ours != theirs).float().mean() < 0.01
    assert ((ours.double() - exact).abs() <= step * 0.51 + 1e-5 * exact.abs().max()).all()


@needs_kernel
def test_the_kernel_reads_strided_input_and_fp32_weights_and_refuses_the_rest():
    ln = norm(64)
    x = torch.randn(3, 10, 128).bfloat16()[..., ::2]
    with torch.inference_mode():
        out = torch.ops.vitkit.layer_norm_bf16(x, ln.weight, ln.bias, ln.eps)
        assert torch.equal(out, torch.ops.vitkit.layer_norm_bf16(x.contiguous(), ln.weight.float(),
                                                                  ln.bias.float(), ln.eps))
        with pytest.raises(RuntimeError, match="expected a bf16 tensor"):
            torch.ops.vitkit.layer_norm_bf16(x.float(), ln.weight, ln.bias, ln.eps)
        with pytest.raises(RuntimeError, match="for rows of 64"):
            torch.ops.vitkit.layer_norm_bf16(x, ln.weight[:32], ln.bias, ln.eps)


@needs_kernel
def test_the_module_runs_the_kernel_only_where_it_applies():
    """bf16 without gradients: the kernel; fp32 input, a gradient wanted, autocast, a hook: nn.LayerNorm's
    own operator, with its gradients."""
    ln = bf16_layer_norms(nn.Sequential(norm(32)))[0]
    assert type(ln) is Bf16LayerNorm
    x = torch.randn(2, 7, 32).bfloat16()
    with torch.no_grad():
        assert operators_called(lambda: ln(x), "vitkit::") == {"vitkit::layer_norm_bf16"}
        assert torch.equal(ln(x), torch.ops.vitkit.layer_norm_bf16(x, ln.weight, ln.bias, ln.eps))
        assert operators_called(lambda: ln.float()(x.float()), "vitkit::") == set()
        ln.bfloat16()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert operators_called(lambda: ln(x), "vitkit::") == set()
    x.requires_grad_()
    assert operators_called(lambda: ln(x), "vitkit::") == set()
    ln(x).float().sum().backward()
    assert x.grad is not None and ln.weight.grad is not None
    handle = ln.register_forward_hook(lambda *args: None)
    with torch.no_grad():
        assert operators_called(lambda: ln(x.detach()), "vitkit::") == set()
    handle.remove()


@needs_kernel
def test_an_optimized_bf16_model_normalises_on_the_kernel():
    """optimize(model, "bf16") on such a CPU: every LayerNorm a Bf16LayerNorm that runs the kernel, and the
    logits close to fp32."""
    model = vitkit.create_model(vitkit.ViTConfig(image_size=32, patch_size=8, dim=64, depth=2, num_heads=4,
                                                 mlp_dim=128, num_classes=10)).eval()
    with torch.no_grad():
        for p in model.parameters():  # the classifier starts at zero, which would hide errors
            p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
    fast = vitkit.optimize(model, "bf16")
    norms = [m for m in fast.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 5 and all(type(m) is Bf16LayerNorm for m in norms)
    if not any(isinstance(m, PackedLinear) for m in fast.modules()):
        pytest.skip("this PyTorch cannot pack oneDNN weights: the bf16 model is not fused here")
    x = torch.randn(4, 3, 32, 32)
    with torch.inference_mode():
        called = operators_called(lambda: fast(x), "vitkit::")
        out, ref = fast(x), model(x)
    assert "vitkit::layer_norm_bf16" in called
    torch.testing.assert_close(out, ref, rtol=0, atol=0.05 * ref.abs().max().item())
