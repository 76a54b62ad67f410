"""Shared by the tests of vitkit's compiled operators: whether a test of an operator must run here (and fail
if the operator did not build), which operators a call runs (by the profiler), and a model's training step
with the operators against the same step without them (VITKIT_KERNELS=0)."""

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F


def warnings_of_two_builds() -> list[str]:
    """The RuntimeWarnings of asking twice for operators that do not exist (what a process sees when the build
    cannot even be tried: they should say so once)."""
    import warnings

    from vitkit.cpu import build

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not build.build_operator("vitkit_test_a", [], "no_such_op_a")
        assert not build.build_operator("vitkit_test_b", [], "no_such_op_b")
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def compiler_present() -> bool:
    """Whether a C++ compiler is on PATH, to build vitkit's operators with."""
    from vitkit.cpu.build import cxx_compiler

    return cxx_compiler() is not None


def operator_skip_reason() -> str | None:
    """Why vitkit's compiled operators cannot be built here (the environment turns them off, or there is no
    C++ compiler), or None: then they must build, and a test of one that is unavailable fails."""
    from vitkit.cpu.build import DISABLE_ENV, kernels_enabled

    if not kernels_enabled():
        return f"{DISABLE_ENV}=0 turns vitkit's compiled operators off"
    if not compiler_present():
        return "no C++ compiler on PATH to build vitkit's operators"
    return None


def require_operator(available: Callable[[], bool], name: str) -> None:
    """Skip the calling test where vitkit's operators cannot be built here (`operator_skip_reason`); elsewhere
    fail it unless `available()` (which builds the operator on its first call) says the operator `name` is
    there."""
    reason = operator_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    if not available():
        pytest.fail(f"vitkit's {name} operator is unavailable although a C++ compiler is on PATH: its build "
                    "failed (the RuntimeWarning above says why)")


def needs_operator(available: Callable[[], bool], name: str):
    """A decorator for a test of the operator `name`: the test first calls `require_operator` (skipped where
    the operators cannot be built here, failed where they should have been and were not), then runs."""

    def decorate(test):
        @functools.wraps(test)  # pytest reads the test's own parameters (fixtures, parametrize) through this
        def run(*args, **kwargs):
            require_operator(available, name)
            return test(*args, **kwargs)

        return run

    return decorate


def operators_called(fn, prefix: str) -> set[str]:
    """The operators whose names start with `prefix` (e.g. "vitkit::gelu") that `fn()` calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages() if e.key.startswith(prefix)}


def training_step_equals_the_fallback(model, x: torch.Tensor, y: torch.Tensor, monkeypatch,
                                      prefix: str) -> set[str]:
    """One training step of `model` with vitkit's operators and one with them turned off: the loss and every
    gradient agree, and the second step calls none of the `prefix` operators. Returns those the first
    called."""

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
