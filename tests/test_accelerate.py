"""vitkit.accelerate: the CPU kernels swapped into a plain model keep its parameters, function and
gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import vitkit
from vitkit.attention import Attention
from vitkit.cpu import accelerate, is_accelerated, plain
from vitkit.cpu.attention import FastAttention
from vitkit.cpu.linear import FastLinear
from vitkit.shortcut import ClassTokenShortcut

TINY = dict(image_size=32, patch_size=8, dim=64, depth=2, num_heads=4, mlp_dim=128, num_classes=5)
VARIANTS = {
    "token": dict(TINY),
    "gap": dict(TINY, pool="gap"),
    "learned-2d": dict(TINY, pos_embed="learned-2d"),
    "hybrid": dict(TINY, image_size=64, patch_size=1, hybrid_layers=(1,), hybrid_width=32),
}


def _model(overrides: dict, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = vitkit.create_model("ViT-Ti/16", **overrides)
    with torch.no_grad():
        # the classifier starts at zero: give it weights so that its gradients are not trivial
        for p in model.head.parameters():
            p.normal_(std=0.1)
    return model


def _images(model: nn.Module, batch: int = 3) -> torch.Tensor:
    cfg = model.cfg
    return torch.randn(batch, cfg.in_chans, *cfg.image_size, generator=torch.Generator().manual_seed(1))


def _logits_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(x)
    (logits.square().sum() + logits.sum()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_same_logits_and_gradients_as_the_plain_model(variant, training):
    model = _model(VARIANTS[variant]).train(training)
    x = _images(model)
    torch.manual_seed(5)
    want_logits, want_grads = _logits_and_grads(model, x)
    fast = accelerate(copy.deepcopy(model))
    assert is_accelerated(fast)
    torch.manual_seed(5)
    got_logits, got_grads = _logits_and_grads(fast, x)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    assert len(got_grads) == len(list(model.parameters()))  # every parameter has a gradient
    for name, want in want_grads.items():
        # to 1e-5 of each gradient's scale: float rounding, another summation order
        error = (got_grads[name] - want).abs().max().item()
        assert error <= 1e-5 * max(1.0, want.abs().max().item()), f"{name}: {error:.2e}"


def test_modules_are_swapped_in_place_with_the_same_parameters():
    model = _model(VARIANTS["token"])
    before = {n: p for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert accelerate(model) is model
    assert all(type(m) is FastLinear for m in model.modules() if isinstance(m, nn.Linear))
    assert all(type(m) is FastAttention for m in model.modules() if isinstance(m, Attention))
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    # the very same Parameter objects: optimizers keep working
    assert all(after[n] is before[n] for n in before)
    new_state = model.state_dict()
    assert new_state.keys() == state.keys()
    for k in state:
        assert torch.equal(new_state[k], state[k]), k


def test_twice_is_once_and_plain_undoes_it():
    model = accelerate(accelerate(_model(VARIANTS["gap"])))
    assert is_accelerated(model)
    x = _images(model)
    y = model(x)
    plain(model)
    assert not is_accelerated(model)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    torch.testing.assert_close(model(x), y, rtol=1e-5, atol=1e-5)


def test_a_model_off_the_cpu_is_left_alone():
    with torch.device("meta"):
        model = vitkit.create_model("ViT-Ti/16", **TINY)
    accelerate(model)
    assert not is_accelerated(model)  # no CPU kernel; the class-token shortcut, which any device takes
    assert type(model) is ClassTokenShortcut


def test_save_and_load_an_accelerated_model(tmp_path):
    model = accelerate(_model(VARIANTS["token"]).eval())
    x = _images(model)
    want = model(x)
    vitkit.save(model, tmp_path / "m")
    loaded = vitkit.load(tmp_path / "m").eval()
    assert not is_accelerated(loaded)  # a checkpoint holds weights and config, not the swap
    torch.testing.assert_close(loaded(x), want, rtol=1e-5, atol=1e-5)
    torch.save(model, tmp_path / "whole.pt")  # pickling keeps the swapped classes
    again = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert is_accelerated(again)
    torch.testing.assert_close(again(x), want, rtol=1e-5, atol=1e-5)


def test_an_optimizer_made_before_the_swap_trains_the_accelerated_model():
    model = _model(VARIANTS["token"]).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerate(model)
    x, y = _images(model, 8), torch.arange(8) % 5
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
