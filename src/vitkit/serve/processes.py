"""`vitkit serve --workers N`: N server processes answering on one port.

One process runs HTTP, the upload's parsing and decoding and the JSON answer on one thread under Python's
global lock; for a small model that thread, not the model, bounds the requests a second. N processes, each
with the whole server and its own copy of the model, run that work on N cores. Each keeps its own batcher,
metrics and warm-up.

The supervisor listens and hands each new connection to the processes in turn (its file descriptor, over a
Unix socket: `hand_over`, `take_connections`). Processes sharing the listening socket instead would each
accept every connection waiting when they wake: 4 keep-alive clients arriving together all land on one
process, 64 split 22 to 42, and the busier process sets the latency.

The supervisor starts the processes (spawned, not forked: a forked PyTorch with live OpenMP threads can
hang), says once when every one is ready, restarts one that dies after it was ready, and stops them all if one
fails to start. SIGTERM or Ctrl-C: every process drains (new requests 503, those in flight answered) and the
supervisor returns 0 once they have exited; a second Ctrl-C stops them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import signal
import socket
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from types import FrameType
from typing import Any


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: one the system chooses), as uvicorn binds one. OSError names
    the address when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


@dataclass
class Supervisor:
    """Runs `target(index, channel, ready, *args)` in `workers` spawned processes and hands them the
    connections `sock` accepts, in turn. `target` is a module-level function that serves the connections
    arriving on `channel` (`take_connections`) and, once warmed up, sends `(index, message)` on the
    connection `ready`. `say(message)` reports the supervisor's own events (all ready; a restart)."""

    target: Callable[..., None]
    args: tuple[Any, ...]
    sock: socket.socket
    workers: int
    say: Callable[[str], None]
    stopping: bool = field(default=False, init=False)
    signals: int = field(default=0, init=False)
    announced: bool = field(default=False, init=False)  # "ready: N server processes" said
    handing_out: bool = field(default=True, init=False)

    def __post_init__(self):
        self.context = multiprocessing.get_context("spawn")
        self.reader, self.ready = self.context.Pipe(duplex=False)
        self.was_ready = [False] * self.workers
        self.processes: list[multiprocessing.Process | None] = [None] * self.workers
        self.channels: list[socket.socket | None] = [None] * self.workers

    def start(self, index: int) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one message, one fd
        process = self.context.Process(target=self.target, args=(index, theirs, self.ready, *self.args),
                                       name=f"vitkit-serve-{index}", daemon=False)
        process.start()
        theirs.close()
        old, self.channels[index] = self.channels[index], mine
        if old is not None:
            old.close()
        self.processes[index] = process

    def hand_out(self) -> None:
        """Accept connections and hand each to the next ready process in turn (skipping one that has gone),
        until every process has exited; then stop listening. A connection handed to a process as it dies
        is lost with it, as it would be had it chosen that process."""
        self.sock.listen(2048)
        self.sock.settimeout(0.2)  # to see that the processes have exited
        turns = itertools.cycle(range(self.workers))
        while self.handing_out:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            with conn:
                for _ in range(self.workers):
                    index = next(turns)
                    channel = self.channels[index]
                    if channel is None or (any(self.was_ready) and not self.was_ready[index]):
                        continue  # a process still warming up waits until the others are all gone
                    with contextlib.suppress(OSError):  # that process has gone: the next one
                        hand_over(channel, conn)
                        break
        self.sock.close()

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
        listener = threading.Thread(target=self.hand_out, name="vitkit-accept", daemon=True)
        try:
            for index in range(self.workers):
                self.start(index)
            listener.start()
            return self._supervise()
        finally:
            self.handing_out = False
            if listener.is_alive():
                listener.join()
            for channel in self.channels:
                if channel is not None:
                    channel.close()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _read_ready(self) -> None:
        while self.reader.poll():
            index, message = self.reader.recv()
            self.was_ready[index] = True
            if self.announced:  # every later ready message is a replacement's
                self.say(f"ready: server process {index} (restarted), {message.removeprefix('ready: ')}")
            elif all(self.was_ready):
                self.announced = True
                self.say(f"ready: {self.workers} server processes, each {message.removeprefix('ready: ')}")

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
                    self.was_ready[index] = False
                    self.start(index)
                else:  # it never became ready: the others would fail alike
                    self.say(f"error: server process {index} exited with code {process.exitcode} before it "
                             "was ready (its error is above); stopping the others")
                    code = process.exitcode or 1
                    self.on_signal(signal.SIGTERM, None)
        return code


def can_hand_over() -> bool:
    """Whether this system can pass connections to the server processes (Unix sockets of SOCK_SEQPACKET
    carrying file descriptors: Linux)."""
    if not (hasattr(socket, "send_fds") and hasattr(socket, "SOCK_SEQPACKET") and hasattr(socket, "AF_UNIX")):
        return False
    try:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except OSError:
        return False
    a.close()
    b.close()
    return True


def hand_over(channel: socket.socket, conn: socket.socket) -> None:
    """Send the accepted connection `conn` to a server process over the Unix socket `channel` (its file
    descriptor, SCM_RIGHTS: the process gets its own copy, and the caller closes its one)."""
    socket.send_fds(channel, [b"c"], [conn.fileno()])


def take_connections(channel: socket.socket, serve: Callable[[socket.socket], Coroutine[Any, Any, Any]],
                     on_close: Callable[[], None]) -> None:
    """In a server process's event loop: run `serve(sock)` as a task for each connection arriving on `channel`
    (e.g. `loop.connect_accepted_socket(protocol, sock)`); `on_close()` when the supervisor has gone (the
    channel reads end of file)."""
    loop = asyncio.get_running_loop()
    channel.setblocking(False)
    tasks: set[asyncio.Task] = set()

    def readable() -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(channel, 64, 64)
            except (BlockingIOError, InterruptedError):
                return
            if not data:
                loop.remove_reader(channel.fileno())
                on_close()
                return
            for fd in fds:
                task = loop.create_task(serve(socket.socket(fileno=fd)))
                tasks.add(task)  # held until done: the loop keeps only weak references to tasks
                task.add_done_callback(tasks.discard)

    loop.add_reader(channel.fileno(), readable)
