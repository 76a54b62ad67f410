"""The private PyTorch APIs that vitkit's CPU speed-ups call, each in one place, behind a check.

A private API may change or vanish with any PyTorch release. Each one is read here through `_lookup`: where
it is missing, vitkit warns once (naming the API) and takes a plain path that computes the same function with
public operators, only slower. Nothing outside `vitkit.cpu` calls these, so a PyTorch upgrade can cost the
fast path its speed, never the model its function.

The APIs:
- `torch.ops.mkldnn._linear_pointwise` (and its `.binary` overload): oneDNN's linear layer, with a fused GELU
  or residual add; plain path `F.linear`.
- `torch.ops.mkldnn._reorder_linear_weight`: a weight reordered into oneDNN's blocked layout; plain path
  the weight as it is.
- `torch.autograd.forward_ad._current_level` and `torch._C._functorch.peek_interpreter_stack`: whether
  forward-mode AD or a torch.func transform is on, where the fast operators (which have no forward derivative
  or batching rule) must give way to PyTorch's; plain path: always give way.
- `torch._foreach_lerp_`: the EMA of the weights in one call over all of them; plain path one `lerp_` each.
- `torch.utils.cpp_extension._get_build_directory`: where a compiled operator's library lies, read only to say
  on stderr that a first build is about to take a while.
- `torch.nn.modules.module._global_forward_hooks` and its three siblings: whether hooks are registered on
  every module, which a fused function that skips a module's call must not bypass; plain path: assume so.
- the `_dynamo_marked_constant` mark that `torch.compiler.assume_constant_result` sets: set directly by
  `constant_under_compile`, as the public decorator imports all of torch._dynamo (2-3 s of every process's
  start, compiling or not); tests/test_cpu_private.py checks that the decorator sets this mark and no other.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def _lookup(name: str, get: Callable[[], Any]) -> Any | None:
    """`get()`, or None with one warning naming `name` where this PyTorch lacks it."""
    try:
        return get()
    except (AttributeError, ImportError, RuntimeError):
        warnings.warn(f"vitkit: this PyTorch ({torch.__version__}) has no {name}; vitkit's CPU speed-ups "
                      "that use it run plain PyTorch operators instead (the same results, slower)",
                      RuntimeWarning, stacklevel=3)
        return None


@functools.cache
def _linear_pointwise() -> Any | None:
    if not torch.backends.mkldnn.is_available():  # a build without oneDNN (not x86): nothing to warn about
        return None
    return _lookup("torch.ops.mkldnn._linear_pointwise", lambda: torch.ops.mkldnn._linear_pointwise)


@functools.cache
def _reorder_linear_weight() -> Any | None:
    return _lookup("torch.ops.mkldnn._reorder_linear_weight",
                   lambda: torch.ops.mkldnn._reorder_linear_weight)


@functools.cache
def _forward_ad_level() -> Callable[[], int] | None:
    def get():
        import torch.autograd.forward_ad as forward_ad

        forward_ad._current_level  # noqa: B018 (read once: raises AttributeError where it is gone)
        return lambda: forward_ad._current_level

    return _lookup("torch.autograd.forward_ad._current_level", get)


@functools.cache
def _functorch_interpreter() -> Callable[[], Any] | None:
    def get():
        from torch._C._functorch import peek_interpreter_stack

        return peek_interpreter_stack

    return _lookup("torch._C._functorch.peek_interpreter_stack", get)


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


@functools.cache
def _global_hook_dicts() -> tuple | None:
    def get():
        from torch.nn.modules import module

        return tuple(getattr(module, name) for name in _GLOBAL_HOOKS)

    return _lookup("torch.nn.modules.module._global_forward_hooks (and its siblings)", get)


def hooked(*modules: torch.nn.Module) -> bool:
    """Whether any of `modules` has a forward or backward hook, or every module has (global hooks): a module
    whose call a fused function skips must have none. True where this PyTorch does not say."""
    dicts = _global_hook_dicts()
    if dicts is None or any(dicts):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in modules)


@functools.cache
def _foreach_lerp() -> Callable | None:
    return _lookup("torch._foreach_lerp_", lambda: torch._foreach_lerp_)


def foreach_lerp_(targets: list[torch.Tensor], sources: list[torch.Tensor], weight: float) -> None:
    """targets[i] += weight * (sources[i] - targets[i]) for every i, in place."""
    op = _foreach_lerp()
    if op is not None:
        op(targets, sources, weight)
        return
    for t, s in zip(targets, sources, strict=True):
        t.lerp_(s, weight)


def onednn_linear_available() -> bool:
    """Whether oneDNN's linear kernel can be called here (x86 builds of PyTorch with oneDNN)."""
    return _linear_pointwise() is not None


def onednn_packing_available() -> bool:
    """Whether oneDNN's linear kernel and its weight reordering can be called here (for packed weights)."""
    return onednn_linear_available() and _reorder_linear_weight() is not None


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  activation: str = "none", approximate: str = "") -> torch.Tensor:
    """x W^T + b through oneDNN, with `activation` "none" or "gelu" (`approximate` "none" or "tanh") fused in;
    `weight` is (out, in), plain (possibly a transposed view) or packed by `pack_weight`. Without oneDNN's
    kernel, F.linear and F.gelu (a packed weight is then the plain one)."""
    op = _linear_pointwise()
    if op is None:
        y = F.linear(x, weight, bias)
        return F.gelu(y, approximate=approximate or "none") if activation == "gelu" else y
    return op(x, weight, bias, activation, [], approximate)


def onednn_linear_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """residual + x W^T + b in one oneDNN call (its binary post-op); F.linear and an add without it."""
    op = _linear_pointwise()
    if op is None:
        return F.linear(x, weight, bias).add_(residual)
    return op.binary(x, residual.contiguous(), weight, bias, "add")


def pack_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """`weight` (out, in) reordered into oneDNN's blocked layout for about `batch_hint` rows; the weight
    itself where this PyTorch cannot reorder (onednn_linear then multiplies it plainly)."""
    reorder = _reorder_linear_weight() if onednn_linear_available() else None
    return weight if reorder is None else reorder(weight, batch_hint)


def forward_ad_may_be_on() -> bool:
    """Whether forward-mode AD is on (a torch.autograd.forward_ad.dual_level) or may be (inside a torch.func
    transform: jvp and jacfwd among them). True where this PyTorch does not say: the fast operators then give
    way to PyTorch's everywhere."""
    level, interpreter = _forward_ad_level(), _functorch_interpreter()
    if level is None or interpreter is None:
        return True
    return level() >= 0 or interpreter() is not None


def plain_ops_required() -> bool:
    """Whether only PyTorch's own operators may run, whatever the tensors: under torch.jit.trace (which the
    legacy ONNX exporter runs too: a traced graph cannot record vitkit's operators), inside a torch.func
    transform (they have no vmap or jvp rule), or with forward-mode AD (they have no forward derivative)."""
    return torch.jit.is_tracing() or forward_ad_may_be_on()


def _eager_on_cpu(x: torch.Tensor) -> bool:
    """`x` on the CPU, not under torch.compile (which traces PyTorch's operators), and not
    `plain_ops_required`."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling() and not plain_ops_required()


def eager_fp32_on_cpu(x: torch.Tensor) -> bool:
    """Whether `x` is where vitkit's CPU kernels take over from PyTorch's: an fp32 tensor on the CPU, no
    autocast, not under torch.compile (which traces PyTorch's operators), and not `plain_ops_required`."""
    return x.dtype == torch.float32 and not torch.is_autocast_enabled("cpu") and _eager_on_cpu(x)


def eager_bf16_on_cpu(x: torch.Tensor) -> bool:
    """Whether `x` is a bf16 tensor on the CPU in eager mode, under autocast or of a model cast to bf16 (not
    compiling, not `plain_ops_required`): where an fp32 kernel may take the tensor cast to fp32."""
    return x.dtype == torch.bfloat16 and _eager_on_cpu(x)


def constant_under_compile(fn: Callable) -> Callable:
    """`fn` marked as torch.compiler.assume_constant_result marks it (dynamo calls it once while tracing and
    puts its result in the graph as a constant), without importing torch._dynamo."""
    fn._dynamo_marked_constant = True
    return fn


def extension_library_exists(name: str) -> bool:
    """Whether torch's extension cache holds a built library `name` already (a first build takes a while, and
    is then announced); False where this PyTorch does not say."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return (Path(_get_build_directory(name, False)) / f"{name}.so").is_file()
    except (AttributeError, ImportError, TypeError):
        print("vitkit: cannot tell whether its CPU operators are built already", file=sys.stderr)
        return False


def extension_build_directory(name: str) -> Path:
    """The folder of torch's extension cache in which library `name` is built (made if missing)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, False))
