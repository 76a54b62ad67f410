"""The model behind the server: its preprocessing, labels, and the one thread that runs it.

Every call into the model goes through `ModelWorker.call`, which runs it on a single thread of its own: the
batches of the classifier and of the attention maps take turns there, the event loop never waits for the
model, and PyTorch gets the machine's cores for one batch at a time."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
import torch.nn as nn

from ..analysis.rollout import attention_rollout
from ..train.predict import label_names, probabilities, top_labels
from .inputs import image_decoder, input_shape

R = TypeVar("R")


class ModelWorker:
    """`model` (as vitkit.load gives it, already on `device`, optionally through vitkit.optimize), served
    under `name`. `max_pixels` caps the decoded size of an uploaded image."""

    def __init__(self, model: nn.Module, name: str, device: torch.device | str = "cpu",
                 max_pixels: int | None = None):
        from ..data.images import MAX_IMAGE_PIXELS

        self.model, self.name, self.device = model, name, torch.device(device)
        self.cfg = model.cfg
        self.names = label_names(model, self.cfg)
        self.decode = image_decoder(self.cfg, MAX_IMAGE_PIXELS if max_pixels is None else max_pixels)
        self.input_shape = input_shape(self.cfg)
        self.ready = False
        self.on_batch_time: Callable[[float], None] | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitkit-model")

    async def call(self, fn: Callable[..., R], *args) -> R:
        """Run `fn(*args)` on the model's thread and wait for it without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, functools.partial(fn, *args))

    def _timed(self, fn: Callable[[torch.Tensor], R], x: torch.Tensor) -> R:
        start = time.perf_counter()
        out = fn(x)
        if self.on_batch_time is not None:
            self.on_batch_time(time.perf_counter() - start)
        return out

    def classify(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Class probabilities, one float32 row per input (C, H, W); on the model's thread."""
        return list(self._timed(lambda x: probabilities(self.model, x, self.device), torch.stack(inputs)))

    def rollout(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The attention rollout of each input (the paper's Fig. 6), one value per patch; on the model's
        thread."""
        def maps(x: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode():
                _, attns = self.model.forward_features(x.to(self.device), return_attention=True)
            return attention_rollout([a.cpu() for a in attns], self.cfg.num_prefix_tokens, pool=self.cfg.pool)

        return list(self._timed(maps, torch.stack(inputs)))

    def top(self, probs: torch.Tensor, k: int) -> list[dict]:
        """The `k` most probable labels of one row of probabilities, as [{"label", "score"}, ...]."""
        ((labels, scores),) = top_labels(probs[None], self.names, k)
        return [{"label": label, "score": score} for label, score in zip(labels, scores, strict=True)]

    async def warm_up(self) -> None:
        """One image of zeros through the classifier and the attention path; `ready` after it."""
        x = torch.zeros(self.input_shape)
        await self.call(self.classify, [x])
        await self.call(self.rollout, [x])
        self.ready = True

    def close(self) -> None:
        self._thread.shutdown(wait=True)
