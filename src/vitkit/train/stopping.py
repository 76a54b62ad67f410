"""Stopping a run without losing work: Ctrl-C (SIGINT) or SIGTERM (`kill`, a scheduler's preemption or time
limit) only asks the loop to stop; it finishes the step in flight, writes a checkpoint at that step and ends
with `TrainingStopped`, from which `--resume` goes on bit for bit. A second Ctrl-C stops at once, losing only
the steps since the last checkpoint, as a SIGKILL would.

Under DDP every process must stop at the same step: the loop sums the processes' requests with the loss check
it makes every step anyway (loop.py), so a signal that reaches one process first stops them all together.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingStopped(RuntimeError):
    """A run stopped on a signal after checkpointing step `step` of `total` into `checkpoint`.
    `exit_code` is the shell's for that signal (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, signum: int, step: int, total: int, checkpoint):
        self.signum, self.step, self.total, self.checkpoint = signum, step, total, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step} of {total}; its "
                         f"checkpoint is {checkpoint}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopRequests:
    """While entered (in the main thread), SIGINT and SIGTERM set `signum` instead of ending the process, and
    the previous handlers come back on exit. A second SIGINT raises KeyboardInterrupt at once. `announce`
    writes one line to stderr when the first signal comes (the main process of a DDP run does)."""

    def __init__(self, announce: bool = True):
        self.signum: int | None = None
        self.announce = announce
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # only there can Python handle signals
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signum = signum
        if self.announce:
            again = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""
            say(f"\n{signal.Signals(signum).name}: stopping after this step, with a checkpoint to resume "
                f"from{again}\n")


def say(message: str) -> None:
    """Write to stderr from a signal handler: with os.write to its file descriptor, as the handler may run
    while the progress bar is inside a write to sys.stderr; through sys.stderr itself where it has none (a
    notebook's or a test's stream). The stop goes ahead whatever the write does."""
    try:
        os.write(sys.stderr.fileno(), message.encode())
    except (AttributeError, OSError, ValueError):
        # io.UnsupportedOperation is both an OSError and a ValueError
        with contextlib.suppress(Exception):  # a message must never cost the checkpoint
            sys.stderr.write(message)


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader worker's `worker_init_fn`: Ctrl-C reaches every process of the terminal's process group,
    and a worker that ended on it would fail the batch the main process waits for before the step could end.
    Workers end with their DataLoader, or on their own when the main process is gone."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
