"""The HTTP routes (Starlette): classification, the Open Inference Protocol, the attention overlay, health,
metrics and the page. `create_app(worker, settings)` gives an ASGI app that uvicorn or a test client runs.

Every error is JSON `{"error": message}` with the status that says what is wrong. Images are decoded in
threads beside the event loop; the model (and its preprocessing) runs on its worker's own thread, in batches
that the two Batchers (classification, attention) form."""

from __future__ import annotations

import asyncio
import html
import importlib.resources
import io
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
from PIL import Image
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import __version__
from ..cpu.hardware import usable_cores
from . import oip
from .batcher import Batcher, Closed, QueueFull, TooMany
from .errors import RequestError
from .guard import ARRIVED, Gate, Guard
from .inputs import form_field
from .metrics import Metrics
from .worker import ModelWorker

MIB = 2**20
# Uploads up to this size are decoded on the event loop (a 28x28 PNG: 30 us), larger ones in a thread.
INLINE_DECODE_BYTES = 4096


@dataclass(frozen=True)
class ServeSettings:
    """The server's limits (the command line's options of the same names)."""

    max_batch_size: int = 16
    max_delay_ms: float = 10.0
    queue_size: int = 64
    timeout_s: float = 30.0
    token: str | None = None
    max_body_bytes: int = 10 * MIB

    def __post_init__(self):
        for name in ("max_batch_size", "queue_size", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.max_delay_ms < 0:
            raise ValueError(f"max_delay_ms={self.max_delay_ms}: must be at least 0")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s}: must be above 0")


log = logging.getLogger("vitkit.serve")


def error_response(request: Request, e: Exception) -> JSONResponse:
    if isinstance(e, RequestError):
        return JSONResponse({"error": e.message}, e.status, e.headers)
    if isinstance(e, HTTPException):  # Starlette's own: an unknown path (404), a wrong method (405)
        what = {404: f"no endpoint {request.url.path}",
                405: f"{request.method} is not allowed on {request.url.path}"}
        return JSONResponse({"error": what.get(e.status_code, e.detail)}, e.status_code, e.headers)
    # The client gets an id to quote, never the exception's text (paths, internals); the log has both.
    incident = uuid.uuid4().hex[:12]
    log.error("failed to answer %s %s (error id %s)", request.method, request.url.path, incident, exc_info=e)
    return JSONResponse({"error": f"the server failed to answer (error id {incident}: its log has the "
                                  "details)", "error_id": incident}, 500)


@asynccontextmanager
async def _anyio_within(seconds: float):
    with anyio.fail_after(seconds):
        yield


# TimeoutError once `seconds` have passed: asyncio's own (Python 3.11+), a fifth of anyio's cost per request
within = getattr(asyncio, "timeout", _anyio_within)


def favicon_ico() -> bytes:
    """The page's icon: an image cut into 4 x 4 patches, in the page's blue (ICO, 16 and 32 pixels)."""
    icon = Image.new("RGBA", (32, 32), (0, 0, 0, 0))
    for row in range(4):
        for col in range(4):
            shade = (59, 111, 216, 255) if (row + col) % 2 == 0 else (120, 158, 232, 255)
            icon.paste(shade, (col * 8 + 1, row * 8 + 1, col * 8 + 7, row * 8 + 7))
    out = io.BytesIO()
    icon.save(out, format="ICO", sizes=[(16, 16), (32, 32)])
    return out.getvalue()


def _report_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the model failed its first run; the server will not become ready",
                  exc_info=task.exception())


class Service:
    """The routes' shared state: the model's worker, the two batchers, the metrics, the settings."""

    def __init__(self, worker: ModelWorker, settings: ServeSettings, metrics: Metrics, gate: Gate):
        self.worker, self.settings, self.metrics, self.gate = worker, settings, metrics, gate
        worker.on_batch_time = metrics.batch_time.observe

        def batcher(run: Callable[[list], list]) -> Batcher:
            return Batcher(lambda items: worker.call(run, items), settings.max_batch_size,
                           settings.max_delay_ms / 1000, settings.queue_size, metrics.observe_batch,
                           all_here=lambda: gate.in_flight <= self.classifier.depth + self.attention.depth)

        self.classifier, self.attention = batcher(worker.classify), batcher(worker.overlays)
        metrics.queue_depth.set_function(lambda: self.classifier.depth + self.attention.depth)
        metrics.in_flight.set_function(lambda: gate.in_flight)
        page = importlib.resources.files("vitkit.serve").joinpath("page.html").read_text(encoding="utf-8")
        self.page = page.replace("{{MODEL}}", html.escape(worker.name))
        self.icon = favicon_ico()
        # Pillow decodes without the GIL: as many decoding threads as the process may use cores
        self.decoders = ThreadPoolExecutor(max_workers=usable_cores(), thread_name_prefix="vitkit-decode")

    @asynccontextmanager
    async def lifespan(self, app: Starlette):
        self.classifier.start()
        self.attention.start()
        # Ready once the model has run every batch size; live (queueing requests behind the warm-up) at once.
        warm_up = asyncio.get_running_loop().create_task(self.worker.warm_up(self.settings.max_batch_size),
                                                         name="vitkit-warm-up")
        warm_up.add_done_callback(_report_failure)
        try:
            yield
        finally:
            await self.classifier.close()
            await self.attention.close()
            warm_up.cancel()
            self.worker.close()
            self.decoders.shutdown(wait=True)

    async def answer(self, request: Request, handler: Callable[[Request], Awaitable[Response]]) -> Response:
        """`handler`'s answer within the timeout counted from the request's arrival (504 after it), with a
        full queue as 503 and Retry-After, a request larger than the whole queue as 413."""
        elapsed = time.monotonic() - request.scope.get(ARRIVED, time.monotonic())
        try:
            async with within(max(0.0, self.settings.timeout_s - elapsed)):
                return await handler(request)
        except TimeoutError:
            raise RequestError(504, f"no answer within {self.settings.timeout_s:g} s (the server's "
                                    "--timeout-s): it is busy; retry later") from None
        except TooMany as e:  # no retry can help: name the limit
            raise RequestError(413, f"{e}: send at most {self.settings.queue_size} images a request (the "
                                    "server's --queue-size)") from None
        except QueueFull as e:
            raise RequestError(503, f"the server is busy: {e}; retry later", {"Retry-After": "1"}) from None
        except Closed:
            raise RequestError(503, "the server is shutting down", {"Retry-After": "1"}) from None

    async def image_input(self, request: Request) -> Image.Image:
        """The uploaded image (the raw body, or a multipart form's `file`), decoded in a decoding thread."""
        data = await request.body()
        content_type = request.headers.get("content-type", "")
        if content_type.startswith("multipart/form-data"):
            data = form_field(data, content_type, "file")
        return await self.decode(data, "the uploaded image")

    async def decode(self, data: bytes, name: str) -> Image.Image:
        """`data` decoded: a small image at once (tens of microseconds, less than handing it to a thread
        costs), a larger one in a decoding thread, beside the event loop."""
        if len(data) <= INLINE_DECODE_BYTES:
            return self.worker.decode(data, name)
        return await asyncio.get_running_loop().run_in_executor(self.decoders, self.worker.decode, data, name)

    # --- the routes ---------------------------------------------------------------------------------------
    async def predictions(self, request: Request) -> Response:
        raw_k = request.query_params.get("top_k", "5")
        if not raw_k.isdigit() or int(raw_k) < 1:
            raise RequestError(400, f"top_k={raw_k!r}: must be an integer of at least 1")

        async def run(request: Request) -> Response:
            x = await self.image_input(request)
            probs = await self.classifier.submit(x)
            return JSONResponse(self.worker.top(probs, int(raw_k)))

        return await self.answer(request, run)

    async def attention_map(self, request: Request) -> Response:
        async def run(request: Request) -> Response:
            png = await self.attention.submit(await self.image_input(request))
            return Response(png, media_type="image/png")

        return await self.answer(request, run)

    def _model(self, request: Request) -> None:
        name = request.path_params["name"]
        if name != self.worker.name:
            raise RequestError(404, f"no model named {name!r}: this server serves {self.worker.name!r}")

    async def model_metadata(self, request: Request) -> Response:
        self._model(request)
        return JSONResponse(oip.metadata(self.worker))

    async def model_ready(self, request: Request) -> Response:
        self._model(request)
        return JSONResponse({"name": self.worker.name, "ready": self.worker.ready},
                            200 if self.worker.ready else 503)

    async def infer(self, request: Request) -> Response:
        self._model(request)

        async def run(request: Request) -> Response:
            parsed = oip.parse_request(await request.body(), self.worker)
            if parsed.images is not None:
                inputs = await asyncio.gather(*(self.decode(d, f"input 'image'[{i}]")
                                                for i, d in enumerate(parsed.images)))
            else:
                inputs = list(parsed.pixels)
            probs = await self.classifier.submit_many(inputs)
            return JSONResponse(oip.response(self.worker, parsed, probs))

        return await self.answer(request, run)

    async def live(self, request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(self, request: Request) -> Response:
        ready = self.worker.ready
        return JSONResponse({"ready": ready}, 200 if ready else 503)

    async def server_metadata(self, request: Request) -> Response:
        return JSONResponse({"name": "vitkit", "version": __version__, "extensions": []})

    async def metrics_text(self, request: Request) -> Response:
        body, content_type = self.metrics.exposition()
        return Response(body, media_type=content_type)

    async def index(self, request: Request) -> Response:
        return HTMLResponse(self.page)

    async def favicon(self, request: Request) -> Response:
        return Response(self.icon, media_type="image/x-icon", headers={"Cache-Control": "max-age=86400"})


class HotPath:
    """In front of Starlette: POST /predictions goes straight to its handler, with the same error answers;
    every other request goes through Starlette's router and error handling. Each `await` of a request
    resumes every coroutine between the server and the handler: Starlette's two error layers, its router and
    its request wrapper cost more than the model for a small model, on every request."""

    def __init__(self, app: ASGIApp, routes: dict[tuple[str, str], Callable[[Request], Awaitable[Response]]]):
        self.app, self.routes = app, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.routes.get((scope.get("method", ""), scope.get("path", ""))) \
            if scope["type"] == "http" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except Exception as e:  # noqa: BLE001 - every error is answered as Starlette's handlers would
            response = error_response(request, e)
        await response(scope, receive, send)


def create_app(worker: ModelWorker, settings: ServeSettings | None = None,
               gate: Gate | None = None) -> ASGIApp:
    """The ASGI app serving `worker`'s model. `gate` is shared with the server that drains it on SIGTERM."""
    settings = settings or ServeSettings()
    gate = gate or Gate()
    metrics = Metrics()
    s = Service(worker, settings, metrics, gate)
    routes = [
        Route("/", s.index, methods=["GET"]),
        Route("/favicon.ico", s.favicon, methods=["GET"]),
        Route("/predictions", s.predictions, methods=["POST"]),
        Route("/attention", s.attention_map, methods=["POST"]),
        Route("/v2", s.server_metadata, methods=["GET"]),
        Route("/v2/health/live", s.live, methods=["GET"]),
        Route("/v2/health/ready", s.ready, methods=["GET"]),
        Route("/v2/models/{name}", s.model_metadata, methods=["GET"]),
        Route("/v2/models/{name}/ready", s.model_ready, methods=["GET"]),
        Route("/v2/models/{name}/infer", s.infer, methods=["POST"]),
        Route("/metrics", s.metrics_text, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=s.lifespan,
                    exception_handlers={RequestError: error_response, HTTPException: error_response,
                                        Exception: error_response})
    return Guard(HotPath(app, {("POST", "/predictions"): s.predictions}), gate=gate, metrics=metrics,
                 token=settings.token, max_body_bytes=settings.max_body_bytes)
