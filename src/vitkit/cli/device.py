"""The `--device` option the commands that run a model share: its help and its parsing into a torch device."""

from __future__ import annotations

DEVICE_HELP = "auto (a GPU when there is one, else the CPU), cpu, cuda or cuda:N."


def parse_device(name: str):
    """The torch device `--device NAME` asks for; a name torch does not know, or a GPU the machine lacks, is a
    usage error naming it."""
    import torch

    from .main import UsageError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r}", "use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {name!r} asked for, but no CUDA device is available", "use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"device {name!r} asked for, but this machine has {torch.cuda.device_count()} "
                         "GPU(s)",
                         "use --device cuda:0, or auto")
    return dev
