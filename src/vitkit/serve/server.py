"""Running the app under uvicorn, with a shutdown that loses no request: on SIGTERM (or Ctrl-C) the server
answers new requests 503 (the readiness probe included), finishes the requests in flight, then closes and
returns, so that the process exits 0. A second Ctrl-C stops at once."""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

from .guard import Gate
from .processes import take_connections


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, draining on the first signal instead of closing at once."""

    def __init__(self, config: uvicorn.Config, gate: Gate, on_listening: Callable[[int], None] | None = None,
                 channel: socket.socket | None = None):
        super().__init__(config)
        self.gate, self.on_listening, self.channel = gate, on_listening, channel

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start-up, then `on_listening(port)` with the port actually bound (--port 0: the one the
        system chose). With a `channel` (one of `vitkit serve --workers` processes) it listens on no socket of
        its own, and serves the connections the supervisor hands it there."""
        if self.channel is None:
            await super().startup(sockets)
            if self.on_listening is not None and getattr(self, "servers", None) and self.servers[0].sockets:
                self.on_listening(self.servers[0].sockets[0].getsockname()[1])
            return
        await super().startup(sockets=[])
        config, loop = self.config, asyncio.get_running_loop()

        def protocol() -> asyncio.Protocol:  # what uvicorn's own listener makes for each connection
            return config.http_protocol_class(config=config, server_state=self.server_state,
                                              app_state=self.lifespan.state)

        def supervisor_gone() -> None:
            self.should_exit = True

        take_connections(self.channel, lambda sock: loop.connect_accepted_socket(protocol, sock),
                         on_close=supervisor_gone)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn's own handler records the signal and raises it again once shut down, which would end the
        # process by that signal; a drained server has done what SIGTERM asks, so it ends normally.
        if self.gate.draining and sig == signal.SIGINT:
            self.should_exit = self.force_exit = True
        self.gate.draining = True

    async def on_tick(self, counter: int) -> bool:
        stop = await super().on_tick(counter)
        return stop or (self.gate.draining and self.gate.in_flight == 0)


def serve(app: ASGIApp, gate: Gate, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          access_log: bool = False, on_listening: Callable[[int], None] | None = None,
          channel: socket.socket | None = None) -> None:
    """Serve `app` (whose Guard shares `gate`) on host:port, or the connections a `vitkit serve --workers`
    supervisor hands over on `channel`, until a signal; returns once drained. `on_listening(port)` is called
    once listening."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=5, server_header=False)
    DrainingServer(config, gate, on_listening, channel).run()
