"""What every HTTP request passes through before a route sees it (an ASGI middleware): the shutdown gate
(503 while draining), the token (401), the body's byte cap (413, from Content-Length at once, else as the body
is read), the count of requests in flight, and the metrics of every answer (status and latency)."""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass

import anyio
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import RequestError
from .metrics import Metrics

# Paths answered without the token: the health probes, and the page and its icon (its requests carry it).
OPEN_PATHS = frozenset({"/", "/favicon.ico", "/v2/health/live", "/v2/health/ready"})
ENDPOINTS = frozenset({"/", "/favicon.ico", "/predictions", "/attention", "/metrics", "/v2",
                       "/v2/health/live", "/v2/health/ready"})
ARRIVED = "vitkit.arrived"  # the scope key holding time.monotonic() at the request's arrival
# How much of a refused request's body is read and dropped before answering: a client still sending it
# (Python's urllib does not wait for an answer first) would otherwise meet a closed socket: a reset.
DRAIN_BYTES, DRAIN_S = 64 * 2**20, 10.0


@dataclass
class Gate:
    """Shared between the middleware and the server: whether it is draining, and how many requests are being
    answered."""

    draining: bool = False
    in_flight: int = 0


def endpoint_label(path: str) -> str:
    """The metrics' endpoint label: the route's template, so that model names and stray paths do not make new
    series."""
    if path in ENDPOINTS:
        return path
    parts = path.split("/")
    if len(parts) in (4, 5) and parts[1:3] == ["v2", "models"]:
        return "/v2/models/{name}" + ("/" + parts[4] if len(parts) == 5 and parts[4] in ("infer", "ready")
                                      else "")
    return "other"


class Guard:
    def __init__(self, app: ASGIApp, gate: Gate, metrics: Metrics, token: str | None, max_body_bytes: int):
        self.app, self.gate, self.metrics = app, gate, metrics
        self.token = token.encode() if token else None
        self.max_body_bytes = max_body_bytes
        self._series: dict[tuple[str, int], tuple] = {}

    def series(self, endpoint: str, status: int) -> tuple:
        """The request counter and latency histogram of an endpoint and status, looked up once."""
        found = self._series.get((endpoint, status))
        if found is None:
            found = self._series[endpoint, status] = (self.metrics.requests.labels(endpoint, str(status)),
                                                      self.metrics.latency.labels(endpoint))
        return found

    def refusal(self, scope: Scope) -> JSONResponse | None:
        """The answer a request gets without reaching a route, or None."""
        path = scope["path"]
        if self.gate.draining and path != "/v2/health/live":
            return JSONResponse({"error": "the server is shutting down"}, 503,
                                {"Retry-After": "1", "Connection": "close"})
        headers = dict(scope["headers"])
        if self.token is not None and path not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not (given.startswith(b"Bearer ") and hmac.compare_digest(given[7:].strip(), self.token)):
                return JSONResponse({"error": "missing or wrong token: send the header 'Authorization: "
                                              "Bearer TOKEN' with the server's --token"}, 401,
                                    {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return JSONResponse({"error": f"Content-Length {length.decode(errors='replace')!r} is not a "
                                              "number of bytes"}, 400)
            if int(length) > self.max_body_bytes:
                return JSONResponse({"error": too_large(int(length), self.max_body_bytes)}, 413)
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        scope[ARRIVED] = start
        status = 500  # if the app fails before it answers

        async def watched_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        received = 0

        async def capped_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    whole = not message.get("more_body") or await drain(receive)
                    headers = {} if whole else {"Connection": "close"}
                    raise RequestError(413, too_large(received, self.max_body_bytes, at_least=True), headers)
            return message

        try:
            refusal = self.refusal(scope)
            if refusal is not None:
                if not await drain(receive):
                    refusal.headers["Connection"] = "close"
                await refusal(scope, receive, watched_send)
                return
            self.gate.in_flight += 1
            try:
                await self.app(scope, capped_receive, watched_send)
            finally:
                self.gate.in_flight -= 1
        finally:
            endpoint = endpoint_label(scope["path"])
            requests, latency = self.series(endpoint, status)
            requests.inc()
            latency.observe(time.monotonic() - start)


async def drain(receive: Receive) -> bool:
    """Read and drop the rest of the request's body (at most DRAIN_BYTES, DRAIN_S), so that a client still
    sending it reads the answer that follows; False if some is left (the connection then closes after it)."""
    dropped = 0
    with anyio.move_on_after(DRAIN_S):
        while dropped <= DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return True
            dropped += len(message.get("body", b""))
    return False


def too_large(size: int, cap: int, at_least: bool = False) -> str:
    return (f"the body is {'at least ' if at_least else ''}{size:,} bytes, more than the server's limit of "
            f"{cap:,} (vitkit serve --max-body-mb)")
