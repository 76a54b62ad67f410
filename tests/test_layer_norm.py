"""vitkit.cpu.layer_norm: the accelerated LayerNorm keeps its output, not its input, for the backward pass,
with LayerNorm's function and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import vitkit
from vitkit.cpu import accelerate
from vitkit.cpu.layer_norm import FastLayerNorm, recoverable
from vitkit.cpu.linear import FastLinear


def _pair(width: int = 48, gain: float = 1.0, bias: float = 0.0) -> tuple[nn.Module, nn.Module]:
    """LayerNorm then a linear layer (a pre-norm block's norm and its consumer), plain and accelerated."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width))
    with torch.no_grad():
        plain[0].weight.copy_(gain * (1 + 0.5 * torch.rand(width)))
        plain[0].bias.copy_(bias * torch.randn(width))
    fast = copy.deepcopy(plain)
    fast[0].__class__, fast[1].__class__ = FastLayerNorm, FastLinear
    return plain, fast


def _run(m: nn.Module, x: torch.Tensor):
    m.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = m(x)
    (out.square().sum() + out.sum()).backward()
    return [out.detach(), x.grad] + [p.grad for p in m.parameters()]


def _saved_bytes(m: nn.Module, x: torch.Tensor) -> int:
    params = {p.data_ptr() for p in m.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x.detach().requires_grad_())
    return sum(seen.values())


@pytest.mark.parametrize("gain,bias", [(1.0, 0.0), (0.3, 1.0), (2.0, 3.0)])
def test_same_output_and_gradients_as_layer_norm(gain, bias):
    plain, fast = _pair(gain=gain, bias=bias)
    x = 3 * torch.randn(2, 17, 48) + 1
    for got, want in zip(_run(fast, x), _run(plain, x), strict=True):
        scale = max(1.0, want.abs().max().item())
        assert (got - want).abs().max().item() <= 1e-5 * scale


def test_the_input_is_not_kept_for_the_backward_pass():
    plain, fast = _pair()
    x = torch.randn(2, 17, 48)
    # x itself and its per-token mean (both keep 1/sigma)
    assert _saved_bytes(plain, x) - _saved_bytes(fast, x) == 2 * 17 * 48 * 4 + 2 * 17 * 4


def test_a_gain_too_small_beside_its_bias_keeps_the_input():
    plain, fast = _pair()
    with torch.no_grad():
        for m in (plain, fast):
            m[0].weight[3] = 1e-4
    assert not recoverable(fast[0].weight, fast[0].bias)
    x = torch.randn(2, 17, 48)
    assert _saved_bytes(fast, x) == _saved_bytes(plain, x)
    for got, want in zip(_run(fast, x), _run(plain, x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_model_accelerated_for_training_keeps_less():
    torch.manual_seed(0)
    model = vitkit.create_model("ViT-Ti/16", image_size=32, patch_size=8, depth=2, num_classes=5).train()
    x = torch.randn(2, 3, 32, 32)
    fast = accelerate(copy.deepcopy(model))
    assert all(type(m) is FastLayerNorm for m in fast.modules() if isinstance(m, nn.LayerNorm))
    tokens = 2 * 17  # every token of the first block's two norms
    assert _saved_bytes(model, x) - _saved_bytes(fast, x) >= 2 * tokens * model.cfg.dim * 4


def test_second_derivatives_agree():
    plain, fast = _pair(gain=0.7, bias=0.5)
    x = torch.randn(2, 9, 48)

    def gradient_penalty(m: nn.Module) -> torch.Tensor:
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(m(xi).square().sum(), xi, create_graph=True)
        g.square().sum().backward()
        return torch.cat([m[0].weight.grad, m[1].weight.grad.flatten()])

    torch.testing.assert_close(gradient_penalty(fast), gradient_penalty(plain), rtol=1e-4, atol=1e-5)


def test_hooks_and_no_gradient_take_layer_norms_path():
    plain, fast = _pair()
    x = torch.randn(2, 17, 48)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), plain(x))
    seen = []
    fast[0].register_forward_hook(lambda m, args, out: seen.append(out.shape))
    assert _saved_bytes(fast, x) == _saved_bytes(plain, x)
    assert seen == [torch.Size([2, 17, 48])]
