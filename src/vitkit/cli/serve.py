"""`vitkit serve`: a model behind HTTP (vitkit.serve), with dynamic batching, the Open Inference Protocol,
metrics and a web page."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from .device import DEVICE_HELP

if TYPE_CHECKING:
    from ..serve import ServeSettings

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def model_name(given: str | None, cfg_name: str | None, model: str) -> str:
    """The name the model is served under (in /v2/models/NAME): --name, else the model's own name, else the
    file or folder name; characters other than letters, digits, '.', '_' and '-' become '-'."""
    name = given or cfg_name or Path(model.rstrip("/")).name or "model"
    safe = re.sub(r"[^A-Za-z0-9._-]", "-", name)
    if given and safe != given:
        from .main import UsageError

        raise UsageError(f"--name {given!r} holds characters a URL path segment cannot",
                         f"e.g. --name {safe}")
    return safe


def serve(
    model: str = typer.Argument(..., help="The model: a checkpoint folder or file, or a hub name (anything "
                                "`vitkit.load` reads)."),
    host: str = typer.Option("127.0.0.1", "--host",
                             help="Address to listen on; the default answers only this machine. 0.0.0.0 "
                                  "answers every network this machine is on."),
    port: int = typer.Option(8000, "--port", min=0, max=65535,
                             help="TCP port to listen on (0: any free port)."),
    max_batch_size: int = typer.Option(16, "--max-batch-size", min=1,
                                       help="Most images the model runs at once."),
    max_delay_ms: float = typer.Option(10.0, "--max-delay-ms", min=0.0,
                                       help="Longest a batch waits for more images after its first arrived, "
                                            "in milliseconds (0: run what is there)."),
    queue_size: int = typer.Option(64, "--queue-size", min=1,
                                   help="Most images waiting for a batch; beyond it requests are answered "
                                        "503 with Retry-After at once."),
    timeout_s: float = typer.Option(30.0, "--timeout-s", min=0.001,
                                    help="A request not answered within this many seconds of its arrival is "
                                         "answered 504."),
    token: str | None = typer.Option(None, "--token", envvar="VITKIT_SERVE_TOKEN", show_default=False,
                                     help="Require 'Authorization: Bearer TOKEN' (401 without it) on every "
                                          "endpoint but the page and the health probes. Also read from "
                                          "VITKIT_SERVE_TOKEN, which other users cannot see in the process "
                                          "list."),
    max_body_mb: float = typer.Option(10.0, "--max-body-mb", min=0.001,
                                      help="Largest request body, in MiB (413 above it)."),
    max_pixels: int | None = typer.Option(None, "--max-pixels", min=1, show_default=False,
                                          help="Most pixels a decoded image may have (413 above it, checked "
                                               "before decoding). Default: Pillow's 89,478,485."),
    name: str | None = typer.Option(None, "--name", show_default=False,
                                    help="The model's name in /v2/models/NAME. Default: the model's own "
                                         "name, else the file or folder name."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    precision: str = typer.Option("fp32", "--precision",
                                  help="vitkit.optimize's precision: fp32 (the same function), int8 (CPU) or "
                                       "bf16 (GPU, or a CPU with native bf16)."),
    threads: int = typer.Option(0, "--threads", min=0,
                                help="CPU threads for the model (0: PyTorch's default, one per core). On a "
                                     "machine shared with other work, or with the clients, fewer threads can "
                                     "be faster: a parallel region waits for its slowest thread."),
    workers: int = typer.Option(1, "--workers", min=1,
                                help="Server processes, each with its own copy of the model, answering on "
                                     "the one port. One process handles HTTP, uploads and answers on one "
                                     "core; for a small model more processes answer more requests a second "
                                     "(up to one per core). Each runs --threads threads (default: the cores "
                                     "shared out between them)."),
    log_level: str = typer.Option("info", "--log-level",
                                  help="uvicorn's log level: critical, error, warning, info, debug or "
                                       "trace."),
    access_log: bool = typer.Option(False, "--access-log/--no-access-log",
                                    help="Log a line for every request (/metrics counts them either way)."),
) -> None:
    """Serve a model over HTTP: POST /predictions, the Open Inference Protocol (/v2/...), POST /attention,
    /metrics, and a page at / to try it in a browser.

    Requests that arrive together run as one batch (up to --max-batch-size, waiting at most --max-delay-ms).
    SIGTERM or Ctrl-C: new requests get 503, those in flight finish, and the command exits 0.
    See docs/serving.md."""
    from .main import UsageError

    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UsageError(f"vitkit serve needs packages that are not installed ({e.name or e})",
                         "pip install 'vitkit[serve]'") from None
    from ..inference import PRECISIONS

    if precision not in PRECISIONS:
        raise UsageError(f"--precision {precision!r}: choose from {', '.join(PRECISIONS)}")
    from ..serve import ServeSettings

    settings = ServeSettings(max_batch_size=max_batch_size, max_delay_ms=max_delay_ms, queue_size=queue_size,
                             timeout_s=timeout_s, token=token, max_body_bytes=round(max_body_mb * 2**20))
    options = ServeOptions(model, host, settings, max_pixels, name, device, precision, threads, workers,
                           log_level, access_log)
    if host not in LOOPBACK and token is None:
        typer.echo(f"warning: serving on {host} without --token: anyone who can reach this port can use it",
                   err=True)
    if workers == 1:
        app, gate, announce = build_server(options, on_ready=lambda message: typer.echo(message, err=True))
        from ..serve.server import serve as run_server

        run_server(app, gate, host, port, log_level, access_log, on_listening=announce)
        return
    from ..serve.processes import Supervisor, bind, can_hand_over

    if not can_hand_over():
        raise UsageError(f"--workers {workers}: handing connections to server processes needs Unix sockets "
                         "that carry file descriptors (Linux)", "run one process: --workers 1")

    served_name = model_name(name, _model_name(model), model)  # a bad --name or model fails here, once
    try:
        sock = bind(host, port)
    except OSError as e:
        raise UsageError(str(e), "choose another --port, or --port 0 for any free one") from None
    typer.echo(f"serving {served_name} ({model}) at http://{host}:{sock.getsockname()[1]}/ from {workers} "
               f"processes (batches of up to {max_batch_size}, waiting at most {max_delay_ms:g} ms)",
               err=True)
    code = Supervisor(serve_process, (options,), sock, workers, lambda m: typer.echo(m, err=True)).run()
    sock.close()
    if code:
        raise typer.Exit(code)


def _model_name(model: str) -> str | None:
    """The model's own name, read as `vitkit.load` reads the model (its errors are the command's)."""
    from .. import load

    return load(model).cfg.name


@dataclass(frozen=True)
class ServeOptions:
    """What each server process is built from: the command's options (picklable, for --workers)."""

    model: str
    host: str
    settings: ServeSettings
    max_pixels: int | None
    name: str | None
    device: str
    precision: str
    threads: int
    workers: int
    log_level: str
    access_log: bool


def build_server(options: ServeOptions, on_ready):
    """The app of one server process for the command's `options`: (app, gate, announce), `announce(port)`
    printing where it listens. `on_ready(message)` is told when the model has warmed up."""
    from .. import load
    from ..cpu.allocator import retain_freed_memory
    from ..cpu.hardware import usable_cores
    from ..inference import optimize
    from ..serve import ModelWorker, create_app
    from ..serve.guard import Gate
    from .device import parse_device

    dev = parse_device(options.device)
    threads = options.threads or (max(1, usable_cores() // options.workers) if options.workers > 1 else 0)
    if threads:
        import torch

        torch.set_num_threads(threads)
    loaded = load(options.model)
    served_name = model_name(options.name, loaded.cfg.name, options.model)
    retain_freed_memory()
    net = optimize(loaded.to(dev), precision=options.precision)
    worker = ModelWorker(net, served_name, dev, options.max_pixels)
    worker.on_ready = on_ready
    gate = Gate()
    app = create_app(worker, options.settings, gate)
    settings = options.settings

    def announce(bound: int) -> None:  # the port actually bound: --port 0 lets the system choose
        typer.echo(f"serving {served_name} ({options.model}) on {dev} at http://{options.host}:{bound}/ "
                   f"(batches of up to {settings.max_batch_size}, waiting at most "
                   f"{settings.max_delay_ms:g} ms)", err=True)

    return app, gate, announce


def serve_process(index: int, channel, ready, options: ServeOptions) -> None:
    """One of `--workers` server processes (spawned by vitkit.serve.processes.Supervisor): the whole server,
    serving the connections handed to it on `channel`; its ready message goes on `ready`."""
    from ..serve.server import serve as run_server

    app, gate, _ = build_server(options, on_ready=lambda message: ready.send((index, message)))
    run_server(app, gate, log_level=options.log_level, access_log=options.access_log, channel=channel)


def register(app: typer.Typer) -> None:
    app.command()(serve)
