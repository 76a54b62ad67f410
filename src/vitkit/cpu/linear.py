"""The linear layer of an accelerated model: nn.Linear whose matrix products run through oneDNN on the CPU.

`FastLinear` is `nn.Linear` (same parameters, same names, same function) with one change of engine: for fp32
tensors on a CPU whose PyTorch build has oneDNN, the forward product x W^T + b and the backward product dY W
may run through oneDNN's linear kernel instead of the MKL `addmm`/`mm` that `F.linear` calls; the weight
gradient dY^T X stays an ordinary `mm`. `vitkit.accelerate` swaps it in for the model's nn.Linear layers.

Which engine is faster depends on the CPU and the shape, and differently for inference and training: products
of at most `MKL_MAX_ROWS` rows (the classifier at batch 1 and 2) stay with MKL, whose matrix-vector kernels
beat oneDNN's; MKL runs its tuned kernels on Intel CPUs only, so there it often wins larger products too. The
engine of each product is chosen per shape by timing both on the machine, once, cached on disk
(vitkit.cpu.autotune: `training_engine_for`, `inference_engine_for`); with tuning off, by a fixed rule
(`machine_training_engine`, `inference_engine`). `VITKIT_TRAINING_ENGINE=onednn|mkl` overrides the training
choice. The cached choice stays the same for the machine, so a resumed run stays bitwise equal to an
uninterrupted one on it.

Everywhere else (CUDA, other dtypes, autocast, torch.compile tracing, torch.jit.trace, torch.func transforms,
forward-mode AD: `vitkit.cpu.private.eager_fp32_on_cpu`) it is exactly `F.linear`, and so in TorchScript; a
second derivative (create_graph=True) goes through PyTorch's products. Results differ from `F.linear` only by
float rounding (another summation order).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import autotune
from .hardware import cpu_isa, cpu_vendor
from .private import eager_fp32_on_cpu, onednn_linear, onednn_linear_available

# Up to this many rows MKL's F.linear beats oneDNN's linear, packed or not (ViT-S/16's fc1 at one row, 2
# threads, AVX-512: 150 against 222-230 us; from 4 rows on oneDNN leads).
MKL_MAX_ROWS = 2
# On Intel CPUs, from this many rows on (four images of 197 tokens make 788) MKL's F.linear beats oneDNN's
# linear again in inference (docs/speed.md, "Studies since removed").
MKL_FROM_ROWS = 768


TRAINING_ENGINES = ("onednn", "mkl")
TRAINING_ENGINE_ENV = "VITKIT_TRAINING_ENGINE"


def _check_engine(name: str, source: str, engines: tuple[str, ...] = TRAINING_ENGINES) -> str:
    if name not in engines:
        raise ValueError(f"{source}={name!r}: expected one of {', '.join(engines)}")
    return name


@functools.lru_cache(maxsize=1)
def machine_training_engine() -> str:
    """This machine's engine for the training products (see the module docstring): the environment variable
    VITKIT_TRAINING_ENGINE where set, else "mkl" on Intel CPUs and on x86 CPUs without AVX-512, "onednn"
    elsewhere. Read once per process.

    Without AVX-512, oneDNN's and MKL's products time level one by one, but whole ViT training steps run
    faster on MKL alone (docs/speed.md, "The training products' engine"); the rule is the autotuner's
    default, kept unless the other engine is MARGIN faster at a shape."""
    chosen = os.environ.get(TRAINING_ENGINE_ENV, "").strip()
    if chosen:
        return _check_engine(chosen.lower(), TRAINING_ENGINE_ENV)
    return "mkl" if cpu_vendor() == "GenuineIntel" or cpu_isa() == "avx2" else "onednn"


_forced_engine: str | None = None


def training_engine() -> str:
    """The engine, "onednn" or "mkl", of the linear layers' products that need a gradient: the one that
    `forced_training_engine` sets, else this machine's (`machine_training_engine`)."""
    return _forced_engine or machine_training_engine()


@contextlib.contextmanager
def forced_training_engine(name: str) -> Iterator[None]:
    """Within the block, the training products run on `name` ("onednn" or "mkl") whatever the machine's
    choice; benchmarks/bench_training.py --engines times both in one process."""
    global _forced_engine
    previous, _forced_engine = _forced_engine, _check_engine(name, "training engine")
    try:
        yield
    finally:
        _forced_engine = previous


INFERENCE_ENGINES = ("auto", "onednn", "mkl")
_forced_inference_engine = "auto"


def inference_engine(n: int) -> str:
    """The engine, "onednn" or "mkl", of a product of `n` rows that needs no gradient (module docstring): MKL
    up to MKL_MAX_ROWS rows and, on Intel CPUs, from MKL_FROM_ROWS rows on; oneDNN otherwise. Within
    `forced_inference_engine("onednn")` every product of more than MKL_MAX_ROWS rows goes to oneDNN, within
    `forced_inference_engine("mkl")` every product to MKL."""
    if n <= MKL_MAX_ROWS or _forced_inference_engine == "mkl":
        return "mkl"
    if _forced_inference_engine == "onednn":
        return "onednn"
    return "mkl" if n >= MKL_FROM_ROWS and cpu_vendor() == "GenuineIntel" else "onednn"


@contextlib.contextmanager
def forced_inference_engine(name: str) -> Iterator[None]:
    """Within the block, the products that need no gradient run on `name`: "onednn" (every product of more
    than MKL_MAX_ROWS rows), "mkl" (every product) or "auto" (`inference_engine`'s rule): to time the engines
    against each other in one process (docs/speed.md gives what that found)."""
    global _forced_inference_engine
    previous, _forced_inference_engine = (_forced_inference_engine,
                                          _check_engine(name, "inference engine", INFERENCE_ENGINES))
    try:
        yield
    finally:
        _forced_inference_engine = previous


def rows(x: torch.Tensor) -> int:
    """The number of rows a linear layer multiplies: every dimension of `x` but the last."""
    return x.numel() // x.shape[-1] if x.dim() > 0 and x.shape[-1] > 0 else 0


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b through oneDNN; `weight` is (out, in) and may be a transposed view."""
    return onednn_linear(x, weight, bias)


class _OneDNNLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: gradients differentiable again, by PyTorch's matmul
            return _differentiable_gradients(ctx, x, weight, grad_out)
        grad_x = grad_w = grad_b = None
        grad_out = grad_out.contiguous()
        if ctx.needs_input_grad[0]:
            grad_x = _onednn_linear(grad_out, weight.t(), None)  # dY W: a linear layer with weight W^T
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = rows.t() @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = rows.sum(0)
        return grad_x, grad_w, grad_b


def _differentiable_gradients(ctx, x: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor):
    """The gradients in x, W and b by PyTorch's own products, themselves differentiable: what a second
    derivative (create_graph=True, e.g. a gradient penalty) needs; oneDNN's linear kernel has none."""
    grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
    rows = grad_out.reshape(-1, grad_out.shape[-1])
    grad_w = rows.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    grad_b = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b


def use_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `FastLinear` may take oneDNN for this input (fp32 on the CPU, more than MKL_MAX_ROWS rows, no
    autocast, not compiling, not tracing, no torch.func transform or forward-mode AD: `eager_fp32_on_cpu`);
    which engine it takes is then `training_engine` or `inference_engine`'s."""
    return (
        eager_fp32_on_cpu(x)
        and weight.dtype == torch.float32
        and x.dim() >= 2
        and rows(x) > MKL_MAX_ROWS
        and onednn_linear_available()
    )


def _shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int, int, bool]:
    return rows(x), weight.shape[1], weight.shape[0], bias is not None


def _operands(n: int, k: int, m: int, has_bias: bool, grad: bool):
    g = autotune.generator()
    x, w = (torch.randn(n, k, generator=g, requires_grad=grad),
            torch.randn(m, k, generator=g, requires_grad=grad))
    b = torch.randn(m, generator=g, requires_grad=grad) if has_bias else None
    return x, w, b


def _training_candidates(n: int, k: int, m: int, has_bias: bool) -> dict[str, Callable[[], Any]]:
    """Forward and backward of an (n, k) x (m, k)^T product on each engine, MKL (PyTorch's own) first."""
    x, w, b = _operands(n, k, m, has_bias, grad=True)
    grad = torch.randn(n, m, generator=autotune.generator())
    inputs = (x, w) if b is None else (x, w, b)

    def step(fn):
        return lambda: torch.autograd.grad(fn(x, w, b), inputs, grad)

    return {"mkl": step(F.linear), "onednn": step(_OneDNNLinearFunction.apply)}


def _inference_candidates(n: int, k: int, m: int, has_bias: bool) -> dict[str, Callable[[], Any]]:
    x, w, b = _operands(n, k, m, has_bias, grad=False)
    return {"mkl": lambda: F.linear(x, w, b), "onednn": lambda: _onednn_linear(x, w, b)}


def training_engine_for(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """The engine of this product with its gradient: `forced_training_engine`'s or VITKIT_TRAINING_ENGINE's
    where set, else the faster on this machine at this shape (vitkit.cpu.autotune; with tuning off,
    `machine_training_engine`)."""
    if _forced_engine or os.environ.get(TRAINING_ENGINE_ENV, "").strip():
        return training_engine()
    shape = _shape(x, weight, bias)
    return autotune.choose("linear-train", shape, lambda: _training_candidates(*shape),
                           machine_training_engine())


def inference_engine_for(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """The engine of this product without a gradient: `forced_inference_engine`'s where set, else the faster
    on this machine at this shape (vitkit.cpu.autotune; with tuning off, `inference_engine`'s rule)."""
    shape = _shape(x, weight, bias)
    if _forced_inference_engine != "auto" or shape[0] <= MKL_MAX_ROWS:
        return inference_engine(shape[0])
    return autotune.choose("linear-infer", shape, lambda: _inference_candidates(*shape),
                           inference_engine(shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b as `FastLinear` computes it (the same engines, the same gradients), for any weight: a
    Linear's own or a slice of one (the last block's query rows)."""
    if not use_onednn(x, weight):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        if training_engine_for(x, weight, bias) == "mkl":
            return F.linear(x, weight, bias)
        return _OneDNNLinearFunction.apply(x, weight, bias)
    if inference_engine_for(x, weight, bias) == "mkl":
        return F.linear(x, weight, bias)
    return _onednn_linear(x, weight, bias)


class FastLinear(nn.Linear):
    """nn.Linear through oneDNN on the CPU (see the module docstring); a drop-in: same parameters and
    names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # TorchScript compiles this branch alone: nn.Linear's product
            return F.linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)
