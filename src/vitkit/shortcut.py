"""The class-token shortcut: a speed-up that `vitkit.accelerate` (training) and `vitkit.optimize`
(inference) swap into a VisionTransformer; the plain model never takes it.

With token pooling, eq. 4 reads only the class token z_L^0, so the last block need update only that token:
its attention still reads every token, so only the keys and values are projected for all of them. The same
logits and gradients for about a sixth of the last block's FLOPs. The plain model runs the whole last block,
as the paper and every other implementation do, so that a forward hook there sees (B, N, D); a model with the
shortcut gives that block's hooks (B, 1, D).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .model import VisionTransformer


class ClassTokenShortcut(VisionTransformer):
    """A VisionTransformer whose `forward` updates only the class token in the last block (module docstring).
    Made by changing a model's class (`with_class_token_shortcut`), never built directly."""

    def forward(self, x: torch.Tensor, streams: torch.Tensor | None = None) -> torch.Tensor:
        if self.cfg.pool != "token" or len(self.blocks) == 0:
            return super().forward(x, streams)
        x = self.embed(x, streams)
        last = len(self.blocks) - 1
        for i in range(last):
            x, _ = self.run_block(i, x, streams)
        x, _ = self.run_block(last, x, streams, queries=self.cfg.num_prefix_tokens)  # (B, 1 or 2, D)
        return self.forward_head(self.norm(x))


def with_class_token_shortcut(model: nn.Module) -> nn.Module:
    """`model` in place with the shortcut, if it is exactly a VisionTransformer (a subclass, such as FSDP's
    wrapper of one, is left alone); returns it. The parameters, state dict and hooks are unchanged."""
    if type(model) is VisionTransformer:
        model.__class__ = ClassTokenShortcut
    return model


def without_class_token_shortcut(model: nn.Module) -> nn.Module:
    """Undo `with_class_token_shortcut` in place; returns `model`."""
    if type(model) is ClassTokenShortcut:
        model.__class__ = VisionTransformer
    return model
