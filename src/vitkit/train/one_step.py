"""One optimizer step's parts: the autocast dtype of a precision, the compiled model (without the notes of
torch's that say nothing about the run), forward and backward over the step's micro-batches, the gradient norm
(and clipping), and the optimizer step."""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn as nn

from ..cpu.build import cxx_compiler
from ..cpu.hardware import cpu_has_native_bf16
from ..streams import DROPOUT, MODEL, fold_in


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of a `precision` on `device` (None: fp32). 'auto': bf16 on CUDA, fp32 on a CPU;
    'bf16': bf16 everywhere (emulated, and slower, on CPUs without native bf16); 'bf16-native': bf16 on CUDA
    and on CPUs that compute bf16 in hardware (AVX512-BF16, AMX), fp32 on other CPUs; 'fp32': never."""
    if precision == "bf16" or (precision in ("auto", "bf16-native") and device.type == "cuda"):
        return torch.bfloat16
    if precision == "bf16-native" and device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return None


class _WithoutProfilerRangeNote(logging.Filter):
    """Drops dynamo's note that it leaves out a profiler range (DDP's forward opens one): a note for each
    process at the first step that says nothing about the training."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Profiler record function")


# The logger dynamo writes that note to; `compiled` gives it the filter once.
PROFILER_NOTE_LOGGER = "torch._dynamo.variables.ctx_manager"


def compiled(net: nn.Module, device: torch.device) -> nn.Module:
    """`net` through torch.compile (inductor), or `net` itself with one warning where inductor cannot build
    its kernels: on the CPU it needs a C++ compiler ($CXX, or c++, g++ or clang++ on PATH)."""
    if device.type == "cpu" and cxx_compiler() is None:
        warnings.warn("vitkit: compile=true but there is no C++ compiler for torch.compile's CPU kernels "
                      "(set CXX or install g++); training without compiling", RuntimeWarning, stacklevel=2)
        return net
    logger = logging.getLogger(PROFILER_NOTE_LOGGER)
    if not any(isinstance(f, _WithoutProfilerRangeNote) for f in logger.filters):
        logger.addFilter(_WithoutProfilerRangeNote())
    return torch.compile(net)


def same_layout_stride_patterns(params: Iterable[torch.Tensor]) -> list[str]:
    """Patterns of DDP's "Grad strides do not match bucket view strides" warning for the mismatches that are
    not mismatches: a parameter with a dimension of size 1 (a grey image's patch projection, [D, 1, P, P])
    whose gradient differs from its bucket only in that dimension's stride. Compiled, that gradient comes back
    so; the memory order is the same, and DDP copies it into the bucket like any other."""
    def listed(values: Iterable[str]) -> str:
        return re.escape("[") + ", ".join(values) + re.escape("]")

    patterns = []
    for p in params:
        if p.dim() < 2 or 1 not in p.shape or not p.is_contiguous():
            continue
        sizes = listed(str(n) for n in p.shape)
        grad = listed(r"\d+" if n == 1 else str(s) for n, s in zip(p.shape, p.stride(), strict=True))
        bucket = listed(str(s) for s in p.stride())
        patterns.append(r"Grad strides do not match bucket view strides\.[\s\S]*"
                        rf"grad\.sizes\(\) = {sizes}, strides\(\) = {grad}\s*"
                        rf"bucket_view\.sizes\(\) = {sizes}, strides\(\) = {bucket}")
    return sorted(set(patterns))


@contextlib.contextmanager
def quiet_same_layout_stride_warnings(model: nn.Module) -> Iterator[None]:
    """Within the block, DDP's stride warning is silenced for `model`'s parameters where it reports the same
    memory order (`same_layout_stride_patterns`); any other mismatch is still reported."""
    with warnings.catch_warnings():
        for pattern in same_layout_stride_patterns(model.parameters()):
            warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
        yield


def dropout_seed(streams: torch.Tensor) -> int:
    """The seed of torch's generator for one micro-batch's dropout: drawn from its first image's stream, so
    that no two micro-batches, and no two processes, share one, and a resumed run draws the same."""
    a, b = fold_in(streams[:1], DROPOUT)[0].tolist()
    return (a << 32) | b


def forward_backward(net: nn.Module, micro_batches: list[tuple[torch.Tensor, ...]],
                     loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device,
                     amp: torch.dtype | None, ddp: bool = False,
                     teacher: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Forward and backward over one step's micro-batches; each loss is divided by their number so that the
    gradients add up to the mean over all of them. Under DDP the gradients are averaged over the processes on
    the last micro-batch only. Returns the mean loss (a 0-d tensor on `device`, not synchronised).

    A micro-batch is (images, labels) or (images, labels, streams): with the images' random streams
    (vitkit.streams), the model draws its drop-path and PatchDropout masks from them and torch's generator is
    seeded from them for dropout (`dropout_seed`), so every draw of the step is a function of the images'
    places in the global batch. With a `teacher` (vitkit.train.distill.Teacher), its classes for the images
    are the loss's third argument."""
    total = torch.zeros((), device=device)
    for j, (x, y, *rest) in enumerate(micro_batches):
        streams = rest[0] if rest else None
        kwargs = {}
        if streams is not None:
            torch.manual_seed(dropout_seed(streams))
            kwargs["streams"] = fold_in(streams, MODEL).to(device, non_blocking=True)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        sync = not ddp or j == len(micro_batches) - 1
        with contextlib.nullcontext() if sync else net.no_sync():
            with torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext():
                logits = net(x, **kwargs)
                taught = () if teacher is None else (teacher(x),)
            # Soft labels (MixUp/CutMix) and integer labels alike; the loss in fp32 even under autocast.
            loss = loss_fn(logits, y, *taught)
            (loss / len(micro_batches)).backward()
        total += loss.detach()
    return total / len(micro_batches)


def gradient_norm(model: nn.Module, max_norm: float = 0.0) -> torch.Tensor:
    """The global L2 norm of `model`'s gradients (a 0-d tensor on their device, not synchronised; over every
    process's shard under FSDP, whose gradients are DTensors), taken before clipping; with `max_norm` > 0 the
    gradients are then scaled down to that norm where it is larger (a non-finite norm makes them non-finite:
    the trainer skips such a step)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = nn.utils.get_total_norm(grads)
    if max_norm:
        nn.utils.clip_grads_with_norm_(grads, max_norm, norm)
    full_tensor = getattr(norm, "full_tensor", None)  # a DTensor under FSDP: the replicated value
    return full_tensor() if callable(full_tensor) else norm


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, clip_grad_norm: float = 0.0) -> None:
    """Clip the global gradient norm (when asked), step, and clear the gradients."""
    if clip_grad_norm:
        gradient_norm(model, clip_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
