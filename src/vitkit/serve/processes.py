"""`vitkit serve --workers N`: N server processes answering on one listening socket.

One process runs HTTP, the upload's parsing and decoding and the JSON answer on one thread under Python's
global lock; for a small model that thread, not the model, bounds the requests a second. N processes, each
with the whole server and its own copy of the model, share one listening socket (bound here, in the
supervising process, and handed to each; the kernel gives each new connection to one of them), so the
per-request Python work runs on N cores. Each process keeps its own batcher, metrics and warm-up.

The supervisor starts the processes (spawned, not forked: a forked PyTorch with live OpenMP threads can
hang), says once when every one is ready, restarts one that dies after it was ready, and stops them all if one
fails to start. SIGTERM or Ctrl-C: every process drains (new requests 503, those in flight answered) and the
supervisor returns 0 once they have exited; a second Ctrl-C stops them at once.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from types import FrameType
from typing import Any


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: one the system chooses), as uvicorn binds one, to be shared
    by the server processes. OSError names the address when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


@dataclass
class Supervisor:
    """Runs `target(index, sock, ready, *args)` in `workers` spawned processes; `target` is a module-level
    function that serves on `sock` and, once warmed up, sends `(index, message)` on the connection `ready`.
    `say(message)` reports the supervisor's own events (all ready; a restart)."""

    target: Callable[..., None]
    args: tuple[Any, ...]
    sock: socket.socket
    workers: int
    say: Callable[[str], None]
    processes: list[multiprocessing.Process | None] = field(default_factory=list)
    stopping: bool = False
    signals: int = 0
    restarted: bool = False

    def __post_init__(self):
        self.context = multiprocessing.get_context("spawn")
        self.reader, self.ready = self.context.Pipe(duplex=False)
        self.was_ready = [False] * self.workers
        self.processes = [None] * self.workers

    def start(self, index: int) -> None:
        process = self.context.Process(target=self.target, args=(index, self.sock, self.ready, *self.args),
                                       name=f"vitkit-serve-{index}", daemon=False)
        process.start()
        self.processes[index] = process

    def on_signal(self, sig: int, frame: FrameType | None) -> None:
        """First signal: every process drains (SIGTERM); a second Ctrl-C: they stop at once (SIGINT again,
        as a terminal sends it to each of them too)."""
        self.signals += 1
        self.stopping = True
        again = self.signals > 1 and sig == signal.SIGINT
        for process in self.processes:
            if process is not None and process.exitcode is None and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):  # it exited since the check
                    os.kill(process.pid, signal.SIGINT if again else signal.SIGTERM)

    def run(self) -> int:
        """Start the processes and supervise them until they have all exited after a signal; the exit code
        (0 when every process drained and exited 0, else the first failure's code)."""
        previous = {s: signal.signal(s, self.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for index in range(self.workers):
                self.start(index)
            return self._supervise()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _read_ready(self) -> None:
        while self.reader.poll():
            index, message = self.reader.recv()
            first_time = not all(self.was_ready) and not self.restarted
            self.was_ready[index] = True
            if first_time and all(self.was_ready):
                self.say(f"ready: {self.workers} server processes, each {message.removeprefix('ready: ')}")
            elif not first_time:
                self.say(f"ready: server process {index} (restarted), {message.removeprefix('ready: ')}")

    def _supervise(self) -> int:
        code = 0
        while any(p is not None for p in self.processes):
            alive = [p.sentinel for p in self.processes if p is not None]
            wait([*alive, self.reader], timeout=1.0)
            self._read_ready()
            for index, process in enumerate(self.processes):
                if process is None or process.exitcode is None:
                    continue
                self.processes[index] = None
                if self.stopping:
                    code = code or process.exitcode
                elif self.was_ready[index]:  # it served, then died: another takes its place
                    self.say(f"warning: server process {index} (pid {process.pid}) exited with code "
                             f"{process.exitcode}; starting another")
                    self.was_ready[index], self.restarted = False, True
                    self.start(index)
                else:  # it never became ready: the others would fail alike
                    self.say(f"error: server process {index} exited with code {process.exitcode} before it "
                             "was ready (its error is above); stopping the others")
                    code = process.exitcode or 1
                    self.on_signal(signal.SIGTERM, None)
        return code
