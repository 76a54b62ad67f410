"""The model behind the server: its preprocessing, labels, and the one thread that runs it.

Every call into the model goes through `ModelWorker.call`, which runs it on a single thread of its own: the
batches of the classifier and of the attention maps take turns there, the event loop never waits for the
model, and PyTorch gets the machine's cores for one batch at a time. Uploads are decoded (Pillow, no PyTorch)
beside the event loop; the model's evaluation transform runs on the model's thread with the batch, so that
only that thread ever starts PyTorch's parallel regions: a second thread running PyTorch operators would
start a second team of OpenMP threads competing for the same cores."""

from __future__ import annotations

import asyncio
import functools
import gc
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
import torch.nn as nn
from PIL import Image

from ..analysis.rollout import attention_rollout
from ..data.transforms import build_eval_transform, eval_batch
from ..train.predict import label_names, probabilities, top_labels
from .inputs import decode_upload, input_shape
from .overlay import overlay_png

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
        self.max_pixels = MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
        self.mode = "L" if self.cfg.in_chans == 1 else "RGB"
        self.transform = build_eval_transform(self.cfg)
        self.input_shape = input_shape(self.cfg)
        self.ready = False
        self.on_batch_time: Callable[[float], None] | None = None
        self.on_ready: Callable[[str], None] | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitkit-model")

    def decode(self, data: bytes, name: str = "image") -> Image.Image:
        """An upload decoded in the model's colour mode (RequestError if bad); in any thread."""
        return decode_upload(data, self.mode, self.max_pixels, name)

    async def call(self, fn: Callable[..., R], *args) -> R:
        """Run `fn(*args)` on the model's thread and wait for it without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, functools.partial(fn, *args))

    def _batch(self, inputs: list[Image.Image | torch.Tensor]) -> torch.Tensor:
        """(B, C, H, W): images through the model's evaluation transform (those of one size together),
        tensors (C, H, W) as they are."""
        images = [i for i, x in enumerate(inputs) if not isinstance(x, torch.Tensor)]
        if len(images) == len(inputs):
            return eval_batch(self.transform, inputs)
        out = list(inputs)
        if images:
            for row, x in zip(images, eval_batch(self.transform, [inputs[i] for i in images]), strict=True):
                out[row] = x
        return torch.stack(out)

    def _timed(self, fn: Callable[[torch.Tensor], R], x: torch.Tensor) -> R:
        start = time.perf_counter()
        out = fn(x)
        if self.on_batch_time is not None:
            self.on_batch_time(time.perf_counter() - start)
        return out

    def classify(self, inputs: list[Image.Image | torch.Tensor]) -> list[torch.Tensor]:
        """Class probabilities, one float32 row per input (a decoded image or a model input (C, H, W)); on
        the model's thread."""
        x = self._batch(inputs)
        return list(self._timed(lambda x: probabilities(self.model, x, self.device), x))

    def attention_maps(self, x: torch.Tensor) -> torch.Tensor:
        """The attention rollout of a batch of model inputs (B, C, H, W): (B, grid h, grid w)."""
        with torch.inference_mode():
            _, attns = self.model.forward_features(x.to(self.device), return_attention=True)
        return attention_rollout([a.cpu() for a in attns], self.cfg.num_prefix_tokens, pool=self.cfg.pool)

    def overlays(self, inputs: list[Image.Image | torch.Tensor]) -> list[bytes]:
        """Each input's attention-rollout overlay (the paper's Fig. 6) as PNG bytes; on the model's thread."""
        x = self._batch(inputs)
        return [overlay_png(xi, mi, self.cfg) for xi, mi in zip(x, self._timed(self.attention_maps, x),
                                                                 strict=True)]

    def top(self, probs: torch.Tensor, k: int) -> list[dict]:
        """The `k` most probable labels of one row of probabilities, as [{"label", "score"}, ...]."""
        ((labels, scores),) = top_labels(probs[None], self.names, k)
        return [{"label": label, "score": score} for label, score in zip(labels, scores, strict=True)]

    async def warm_up(self, max_batch_size: int = 1) -> float:
        """Every batch size the batchers can form (1 to `max_batch_size`) through the classifier and the
        attention maps, so that no request waits for a first call's work at a new shape (vitkit's kernels
        choose their implementation per shape by timing them), and one overlay picture; in one call on the
        model's thread, requests queueing behind it. `ready` after it, and `on_ready(message)` told how long
        it took. Returns the seconds taken."""
        start = time.perf_counter()
        await self.call(self._warm_up, max_batch_size)
        took = time.perf_counter() - start
        self.ready = True
        if self.on_ready is not None:
            sizes = "1" if max_batch_size == 1 else f"1 to {max_batch_size}"
            self.on_ready(f"ready: warmed up batches of {sizes} in {took:.1f} s")
        return took

    def _warm_up(self, max_batch_size: int) -> None:
        x = torch.zeros(self.input_shape)
        self.overlays([x])
        for size in range(1, max_batch_size + 1):
            self.classify([x] * size)
            self.attention_maps(torch.stack([x] * size))
        # The model, PyTorch and the libraries are some 300,000 objects the garbage collector would walk at
        # each full collection (0.2 s with the GIL held: a stall of every request in flight); they live as
        # long as the server, so they leave its watch. Requests' own objects are collected as before.
        gc.collect()
        gc.freeze()

    def close(self) -> None:
        self._thread.shutdown(wait=True)
