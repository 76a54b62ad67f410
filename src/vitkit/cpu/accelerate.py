"""`accelerate(model)`: vitkit's CPU kernels swapped into a model in place, for training and evaluation.

Each nn.Linear becomes a `FastLinear`, each of the model's `Attention` layers a `FastAttention`, each `Mlp` a
`FastMlp` (which keeps GELU's input alone for the backward pass) and each nn.LayerNorm a `FastLayerNorm`
(which keeps its output, not its input), by changing the module's class: the same parameter objects under the
same names (so the state dict, an optimizer made before, hooks and `torch.save` are unaffected), the same
function and gradients to float rounding. The swap is done only where the kernels can run, on a model on the
CPU; a model elsewhere (a GPU) keeps PyTorch's modules. On any device the model itself takes the class-token
shortcut (`vitkit.shortcut`: its last block updates the class token only, the same logits and gradients). The
kernels themselves fall back to PyTorch's operators wherever they do not apply (other dtypes, autocast,
torch.compile, torch.func transforms, forward-mode AD).
"""

from __future__ import annotations

import torch.nn as nn

from ..attention import Attention
from ..model import Mlp
from ..shortcut import with_class_token_shortcut, without_class_token_shortcut
from .attention import FastAttention
from .layer_norm import FastLayerNorm
from .linear import FastLinear
from .mlp import FastMlp

# The classes swapped in, by the class they replace (exactly that class: subclasses are someone else's).
SWAPS: dict[type[nn.Module], type[nn.Module]] = {nn.Linear: FastLinear, Attention: FastAttention,
                                                Mlp: FastMlp, nn.LayerNorm: FastLayerNorm}
# Their inverse, for `plain`.
PLAIN = {fast: plain for plain, fast in SWAPS.items()}


def _on_cpu(model: nn.Module) -> bool:
    devices = {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()}
    return devices <= {"cpu"}


def accelerate(model: nn.Module) -> nn.Module:
    """Swap vitkit's CPU kernels into `model` in place (module docstring) and return it; a model not on the
    CPU gets the class-token shortcut only. Calling it twice changes nothing more."""
    with_class_token_shortcut(model)
    if not _on_cpu(model):
        return model
    for module in model.modules():
        fast = SWAPS.get(type(module))
        if fast is not None:
            module.__class__ = fast
    return model


def plain(model: nn.Module) -> nn.Module:
    """Undo `accelerate` in place: every swapped module back to its PyTorch or vitkit class; returns
    `model`."""
    without_class_token_shortcut(model)
    for module in model.modules():
        original = PLAIN.get(type(module))
        if original is not None:
            module.__class__ = original
    return model


def is_accelerated(model: nn.Module) -> bool:
    """Whether any module of `model` is one of accelerate's CPU kernels (the class-token shortcut aside)."""
    return any(type(m) in PLAIN for m in model.modules())
