"""Exponential moving average of the weights (Polyak averaging, used for the paper's ImageNet results)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..cpu.private import foreach_lerp_


class EMA:
    """Keeps `decay * average + (1 - decay) * weights` after every optimizer step, in the weights' own dtype
    (fp32 in vitkit's training, whose mixed precision keeps fp32 weights and autocasts the computation).

    `module` is a copy of the model holding the averaged parameters (buffers are copied, not averaged); use it
    for evaluation. It is a deep copy of `model`, or the copy given (under FSDP, one sharded alike:
    sharding.sharded_copy). The first updates use a smaller decay, min(decay, (1 + n) / (10 + n)) after n
    updates, so that the random initialisation is forgotten quickly (as TensorFlow's ExponentialMovingAverage
    with num_updates). That ramp is slow for decays near 1: with the paper's Polyak factor 0.9999 the decay is
    still 0.99955 after 20k steps (an average over the last ~2k steps, not ~10k).
    """

    def __init__(self, model: nn.Module, decay: float, module: nn.Module | None = None):
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay={decay}: need 0 < decay < 1")
        self.decay = decay
        self.updates = 0
        self.module = (copy.deepcopy(model) if module is None else module).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        d = self.current_decay()
        ema_params = list(self.module.parameters())
        params = [p.detach() for p in model.parameters()]
        foreach_lerp_(ema_params, params, 1.0 - d)  # ema += (1 - d) * (p - ema)
        for b_ema, b in zip(self.module.buffers(), model.buffers(), strict=True):
            b_ema.copy_(b)
        self.updates += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor], updates: int) -> None:
        self.module.load_state_dict(state)
        self.updates = updates
