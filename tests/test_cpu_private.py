"""vitkit.cpu.private: with every private PyTorch API it reads taken away, the model, its training and
vitkit.optimize give the same results, through plain PyTorch operators, after one warning per missing API."""

from __future__ import annotations

import copy
import subprocess
import sys
import types
import warnings

import pytest
import torch
import torch.nn as nn

import vitkit
from vitkit.cpu import accelerate, private

CACHED = (private._linear_pointwise, private._reorder_linear_weight, private._forward_ad_level,
          private._functorch_interpreter, private._foreach_lerp, private._global_hook_dicts)
TINY = dict(image_size=32, patch_size=8, dim=64, depth=2, num_heads=4, mlp_dim=128, num_classes=5)


def _clear_caches() -> None:
    for lookup in CACHED:
        lookup.cache_clear()


@pytest.fixture
def without_private_apis(monkeypatch):
    """torch.ops.mkldnn (oneDNN's linear and its weight reordering), forward AD's level, functorch's
    interpreter stack and torch._foreach_lerp_, gone as a PyTorch release might remove them. torch._dynamo
    (which an optimizer's construction imports, and whose import reads torch._foreach_lerp_) is loaded
    first, as it would be in a release that lacks the API."""
    import torch._dynamo  # noqa: F401

    monkeypatch.setattr(torch.ops, "mkldnn", types.SimpleNamespace())
    monkeypatch.delattr(torch.autograd.forward_ad, "_current_level")
    monkeypatch.delattr(torch._C._functorch, "peek_interpreter_stack")
    monkeypatch.delattr(torch, "_foreach_lerp_")
    _clear_caches()
    yield
    _clear_caches()  # read again once monkeypatch has put them back


def _model(seed: int = 0, **overrides) -> nn.Module:
    torch.manual_seed(seed)
    model = vitkit.create_model("ViT-Ti/16", **{**TINY, **overrides})
    with torch.no_grad():
        for p in model.head.parameters():
            p.normal_(std=0.1)
    return model


def _train(model: nn.Module, steps: int = 4) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 3, 32, 32, generator=g), torch.randint(0, 5, (6,), generator=g)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_the_lookups_warn_once_each_and_fall_back(without_private_apis):
    with pytest.warns(RuntimeWarning) as record:
        assert not private.onednn_linear_available()
        assert not private.onednn_packing_available()
        assert private.forward_ad_may_be_on()  # cannot tell: the fast operators give way everywhere
        assert private.plain_ops_required()
        assert not private.eager_fp32_on_cpu(torch.zeros(2))
        private.foreach_lerp_([torch.zeros(1)], [torch.ones(1)], 0.5)
    names = " ".join(str(w.message) for w in record)
    for api in ("_linear_pointwise", "_current_level", "peek_interpreter_stack", "_foreach_lerp_"):
        assert api in names
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: a second round is silent
        private.onednn_linear_available(), private.forward_ad_may_be_on(), private.foreach_lerp_([], [], 0.5)
    targets, sources = [torch.zeros(3), torch.ones(2)], [torch.ones(3), torch.zeros(2)]
    private.foreach_lerp_(targets, sources, 0.25)
    assert targets[0].tolist() == [0.25] * 3 and targets[1].tolist() == [0.75] * 2
    x, w, b = torch.randn(4, 8), torch.randn(3, 8), torch.randn(3)
    torch.testing.assert_close(private.onednn_linear(x, w, b, "gelu", "tanh"),
                               nn.functional.gelu(x @ w.T + b, approximate="tanh"))
    assert private.pack_weight(w, 4) is w


def test_hooked_sees_module_and_global_hooks_and_assumes_them_where_it_cannot_tell(monkeypatch):
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    _clear_caches()
    assert not private.hooked(a, b)
    handle = b.register_forward_pre_hook(lambda m, args: None)
    assert private.hooked(a, b) and not private.hooked(a)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: None)
    assert private.hooked(a)
    handle.remove()
    assert not private.hooked(a)
    monkeypatch.delattr(nn.modules.module, "_global_forward_hooks")  # gone, as a release might remove it
    _clear_caches()
    with pytest.warns(RuntimeWarning, match="_global_forward_hooks"):
        assert private.hooked(a)
    monkeypatch.undo()
    _clear_caches()


def test_the_apis_are_there_on_this_build():
    """The other half: where PyTorch has them (x86 builds with oneDNN), they are found and used."""
    _clear_caches()
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch build has no oneDNN")
    assert private.onednn_packing_available()
    assert not private.forward_ad_may_be_on()
    assert private.eager_fp32_on_cpu(torch.zeros(2))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("pool", ["token", "gap"])
def test_model_training_and_optimize_give_the_same_results_without_them(without_private_apis, pool):
    model = _model(pool=pool).eval()
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
    fast = accelerate(copy.deepcopy(model))
    with torch.no_grad():
        torch.testing.assert_close(fast(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vitkit.optimize(model)(x), want, rtol=1e-4, atol=1e-4)
        int8 = vitkit.optimize(model, "int8")(x)
    assert (int8.argmax(1) == want.argmax(1)).float().mean() >= 2 / 3
    assert (int8 - want).abs().max() < 0.1 * want.abs().max()
    plain_losses = _train(_model(pool=pool).train())
    fast_losses = _train(accelerate(_model(pool=pool).train()))
    assert plain_losses[-1] < plain_losses[0]
    torch.testing.assert_close(torch.tensor(fast_losses), torch.tensor(plain_losses), rtol=1e-5, atol=1e-5)


def test_the_compile_constant_mark_is_the_public_decorators_and_loads_no_dynamo():
    """constant_under_compile sets what torch.compiler.assume_constant_result sets, and nothing else; a
    process that imports vitkit's CPU operators has not imported torch._dynamo (seconds of start-up)."""
    def ours():
        return 1

    def public():
        return 1

    assert private.constant_under_compile(ours) is ours
    assert torch.compiler.assume_constant_result(public) is public
    assert vars(ours) == vars(public) == {"_dynamo_marked_constant": True}
    code = "import sys, vitkit, vitkit.cpu; print('torch._dynamo' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False"
