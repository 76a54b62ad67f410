"""Dynamic batching in pure asyncio: requests that arrive close together run as one batch.

A batch closes when it holds `max_batch_size` items or `max_delay` seconds after its first item *arrived*
(not after the worker first saw it): an item that waited while the previous batch ran starts at once. One
worker task runs the batches one after another through `run`, an async function (the server hands each batch
to the one thread that owns the model). A full queue refuses at once (QueueFull). A caller that stops waiting
(a timeout, a client that went away) cancels only its own item: a queued item is skipped, a running one's
result is dropped, and neither its batch nor the next is disturbed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class QueueFull(Exception):
    """The queue holds `queue_size` items already; the caller should retry later."""


class TooMany(Exception):
    """More items in one call than the queue can ever hold: retrying cannot help."""


class Closed(Exception):
    """The batcher was closed: it takes no new items."""


@dataclass
class _Entry(Generic[T, R]):
    item: T
    future: asyncio.Future[R]
    arrived: float  # loop.time() when submitted


class Batcher(Generic[T, R]):
    """Collects submitted items into batches for `run(items) -> results` (one result per item, in order).

    `on_batch(size, waits)`, if given, is called as each batch starts, with the seconds each of its items
    waited in the queue (for metrics). Create it, `start()` it inside the running event loop, and `close()`
    it.
    """

    def __init__(self, run: Callable[[list[T]], Awaitable[Sequence[R]]], max_batch_size: int = 16,
                 max_delay: float = 0.010, queue_size: int = 64,
                 on_batch: Callable[[int, list[float]], None] | None = None,
                 all_here: Callable[[], bool] | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: must be at least 1")
        if max_delay < 0:
            raise ValueError(f"max_delay={max_delay}: must be at least 0 seconds")
        if queue_size < 1:
            raise ValueError(f"queue_size={queue_size}: must be at least 1")
        self.run, self.on_batch, self.all_here = run, on_batch, all_here
        self.max_batch_size, self.max_delay, self.queue_size = max_batch_size, max_delay, queue_size
        self._pending: collections.deque[_Entry[T, R]] = collections.deque()
        self._wakeup = asyncio.Event()
        self._wake_at = 1  # the queue length at which a submission wakes the worker
        self._worker: asyncio.Task[None] | None = None
        self._closed = False
        self.running = 0  # items in the batch being run

    @property
    def depth(self) -> int:
        """Items waiting for a batch (those whose caller stopped waiting are not counted)."""
        return sum(not e.future.done() for e in self._pending)

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._loop(), name="vitkit-batcher")

    async def close(self) -> None:
        """Take no new items, let the worker finish those queued, then stop it."""
        self._closed = True
        while self._worker is not None and not self._worker.done() and (self.depth or self.running):
            await asyncio.sleep(0.01)
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None

    async def submit(self, item: T) -> R:
        """Queue `item` and wait for its result; QueueFull at once when the queue is full."""
        return (await self.submit_many([item]))[0]

    async def submit_many(self, items: Sequence[T]) -> list[R]:
        """Queue all of `items` (or, when the queue has no room for all of them, none: QueueFull) and wait for
        their results. Cancelling the wait cancels the items not yet run."""
        if self._closed:
            raise Closed("the batcher is closed")
        if self._worker is None or self._worker.done():
            raise RuntimeError("the batcher is not running: call start() inside the event loop first")
        if len(items) > self.queue_size:
            raise TooMany(f"{len(items)} items in one request, and the queue holds at most {self.queue_size}")
        # the queue's length counts items whose callers stopped waiting too: the exact count only near the top
        if len(self._pending) + len(items) > self.queue_size and self.depth + len(items) > self.queue_size:
            raise QueueFull(f"the queue holds {self.depth} of at most {self.queue_size} items")
        loop = asyncio.get_running_loop()
        now = loop.time()
        entries = [_Entry(item, loop.create_future(), now) for item in items]
        self._pending.extend(entries)
        if len(self._pending) >= self._wake_at:  # the worker waits for a first item, or for a full batch
            self._wakeup.set()
        try:
            return list(await asyncio.gather(*(e.future for e in entries)))
        finally:
            for e in entries:  # on cancellation or an error: the others are not waited for either
                e.future.cancel()

    def _drop_abandoned(self) -> None:
        while self._pending and self._pending[0].future.done():
            self._pending.popleft()

    async def _next_batch(self) -> list[_Entry[T, R]]:
        """Wait for a first live item, then until the batch is full or max_delay after that item arrived."""
        loop = asyncio.get_running_loop()
        while True:
            self._drop_abandoned()
            if self._pending:
                break
            self._wake_at = 1
            self._wakeup.clear()
            await self._wakeup.wait()
        deadline = self._pending[0].arrived + self.max_delay
        # One timer for the batch's deadline. A submission wakes the worker only when it could end the wait:
        # any new item where `all_here` is asked again, else the one that fills the batch. The timer's having
        # run ends the wait, not a second reading of the clock: uvloop keeps whole milliseconds, and its timer
        # may run while loop.time() still reads a float rounding below the deadline.
        expired = loop.time() >= deadline

        def expire() -> None:
            nonlocal expired
            expired = True
            self._wakeup.set()

        timer = loop.call_at(deadline, expire)
        try:
            while self.depth < self.max_batch_size and not expired:
                if self.all_here is not None and self.all_here():
                    break
                self._wake_at = len(self._pending) + 1 if self.all_here is not None else self.max_batch_size
                self._wakeup.clear()
                await self._wakeup.wait()
        finally:
            timer.cancel()
            self._wake_at = 1
        batch: list[_Entry[T, R]] = []
        while self._pending and len(batch) < self.max_batch_size:
            e = self._pending.popleft()
            if not e.future.done():
                batch.append(e)
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            if not batch:  # every item of it was abandoned while the batch filled
                continue
            if self.on_batch is not None:
                start = loop.time()
                self.on_batch(len(batch), [start - e.arrived for e in batch])
            self.running = len(batch)
            try:
                results = await self.run([e.item for e in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"run returned {len(results)} results for a batch of {len(batch)}")
            except asyncio.CancelledError:
                for e in batch:
                    e.future.cancel()
                raise
            except Exception as error:  # the batch's callers get the error; the worker goes on
                for e in batch:
                    if not e.future.done():
                        e.future.set_exception(error)
            else:
                for e, r in zip(batch, results, strict=True):
                    if not e.future.done():  # its caller may have stopped waiting
                        e.future.set_result(r)
            finally:
                self.running = 0
