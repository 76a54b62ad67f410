"""vitkit.cpu.mlp: the accelerated MLP keeps GELU's input alone for its backward pass, with the function and
gradients of the model's Mlp."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import vitkit
from vitkit.config import ViTConfig
from vitkit.cpu import accelerate
from vitkit.cpu.linear import FastLinear, forced_training_engine
from vitkit.cpu.mlp import FastMlp, gelu_linear
from vitkit.model import Mlp


def _mlps(gelu: str = "exact", dropout: float = 0.0) -> tuple[Mlp, FastMlp]:
    torch.manual_seed(0)
    cfg = ViTConfig(dim=48, mlp_dim=192, depth=1, num_heads=4, gelu=gelu, dropout=dropout)
    mlp = Mlp(cfg)
    fast = copy.deepcopy(mlp)
    for m in fast.modules():
        if type(m) is nn.Linear:
            m.__class__ = FastLinear
    fast.__class__ = FastMlp
    return mlp, fast


def _run(mlp: nn.Module, x: torch.Tensor, seed: int = 3):
    mlp.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    out = mlp(x)
    (out.square().sum() + out.sum()).backward()
    return out.detach(), x.grad, {n: p.grad for n, p in mlp.named_parameters()}


def _saved_bytes(mlp: nn.Module, x: torch.Tensor) -> int:
    """The bytes of the activations autograd keeps for the backward pass (the parameters left out)."""
    params = {p.data_ptr() for p in mlp.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.data_ptr() not in params:
            seen[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x.detach().requires_grad_())
    return sum(seen.values())


@pytest.mark.parametrize("engine", ["onednn", "mkl"])
@pytest.mark.parametrize("gelu", ["exact", "tanh"])
def test_same_output_and_gradients_as_the_mlp(gelu, engine):
    mlp, fast = _mlps(gelu)
    x = torch.randn(3, 17, 48)
    want = _run(mlp, x)
    with forced_training_engine(engine):
        got = _run(fast, x)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, rtol=1e-5, atol=1e-5, msg=name)


def test_gelus_output_is_not_kept_for_the_backward_pass():
    mlp, fast = _mlps()
    x = torch.randn(2, 17, 48)
    activation = 2 * 17 * 192 * 4  # one (tokens, mlp_dim) fp32 tensor
    plain, kept = _saved_bytes(mlp, x), _saved_bytes(fast, x)
    assert plain - kept == activation, (plain, kept)


def test_a_model_accelerated_for_training_keeps_less():
    torch.manual_seed(0)
    model = vitkit.create_model("ViT-Ti/16", image_size=32, patch_size=8, depth=2, num_classes=5).train()
    x = torch.randn(2, 3, 32, 32)
    plain = _saved_bytes(model, x)
    fast = accelerate(copy.deepcopy(model))
    assert all(type(b.mlp) is FastMlp for b in fast.blocks)
    tokens = 2 * 17 + 2 * 1  # every token in the first block; the class token alone in the last (shortcut)
    assert plain - _saved_bytes(fast, x) >= tokens * model.cfg.mlp_dim * 4


def test_dropout_between_the_layers_takes_the_mlps_path():
    mlp, fast = _mlps(dropout=0.3)
    x = torch.randn(3, 17, 48)
    want, got = _run(mlp.train(), x, seed=7), _run(fast.train(), x, seed=7)
    assert _saved_bytes(fast, x) == _saved_bytes(mlp, x)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_a_hook_on_fc2_still_sees_its_call():
    _, fast = _mlps()
    seen = []
    fast.fc2.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    _run(fast, torch.randn(3, 17, 48))
    assert seen == [torch.Size([3, 17, 192])]


def test_second_derivatives_agree():
    mlp, fast = _mlps()
    x = torch.randn(2, 9, 48)

    def gradient_penalty(m: nn.Module) -> torch.Tensor:
        xi = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(m(xi).square().sum(), xi, create_graph=True)
        g.square().sum().backward()
        return m.fc1.weight.grad.clone()

    torch.testing.assert_close(gradient_penalty(fast), gradient_penalty(mlp), rtol=1e-4, atol=1e-5)


def test_gelu_linear_without_a_gradient_is_the_two_operators():
    h, w, b = torch.randn(5, 7, 30), torch.randn(11, 30), torch.randn(11)
    want = torch.nn.functional.linear(torch.nn.functional.gelu(h), w, b)
    torch.testing.assert_close(gelu_linear(h, w, b), want, rtol=1e-5, atol=1e-5)


def test_a_global_module_hook_takes_the_mlps_path():
    mlp, fast = _mlps()
    x = torch.randn(2, 17, 48)
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: None)
    try:
        assert _saved_bytes(fast, x) == _saved_bytes(mlp, x)
    finally:
        handle.remove()
    assert _saved_bytes(fast, x) < _saved_bytes(mlp, x)
