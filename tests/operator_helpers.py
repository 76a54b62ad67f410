"""Shared by the tests of vitkit's compiled operators: which operators a call runs (by the profiler), and a
model's training step with the operators against the same step without them (VITKIT_KERNELS=0)."""

import torch
import torch.nn.functional as F


def operators_called(fn, prefix: str) -> set[str]:
    """The operators whose names start with `prefix` (e.g. "vitkit::gelu") that `fn()` calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages() if e.key.startswith(prefix)}


def training_step_equals_the_fallback(model, x: torch.Tensor, y: torch.Tensor, monkeypatch, prefix: str) -> set[str]:
    """One training step of `model` with vitkit's operators and one with them turned off: the loss and every
    gradient agree, and the second step calls none of the `prefix` operators. Returns those the first called."""

    def step():
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    called = operators_called(step, prefix)
    loss, grads = step()
    with monkeypatch.context() as m:
        m.setenv("VITKIT_KERNELS", "0")
        assert not operators_called(step, prefix)
        ref_loss, ref_grads = step()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    return called
