"""What the serve tests share: tiny models, a model worker that can be made slow, test images, and a real
uvicorn server on a free loopback port, run in a thread of the test process."""

from __future__ import annotations

import contextlib
import io
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import sklearn
import torch
import uvicorn
from PIL import Image

import vitkit
from vitkit.serve import ModelWorker, ServeSettings, create_app

PHOTOS = Path(sklearn.__file__).parent / "datasets" / "images"  # china.jpg and flower.jpg, 427x640
CLASSES = ["tench", "goldfinch", "great white shark", "tree frog", "coral reef", "daisy", "pagoda"]


def tiny_model(in_chans: int = 3, image_size: int = 32, patch_size: int = 8, num_classes: int = len(CLASSES)):
    """A 2-layer ViT with named classes, as vitkit.load gives one."""
    cfg = vitkit.get_config("ViT-Ti/16", image_size=image_size, patch_size=patch_size, in_chans=in_chans,
                            num_classes=num_classes, depth=2, dim=32, num_heads=2, mlp_dim=64)
    model = vitkit.create_model(cfg.replace(name="tiny"))
    with torch.no_grad():  # ViT's classifier starts at zero, which would make every class equally probable
        model.head.weight.normal_(0.0, 1.0)
    model.class_names = CLASSES[:num_classes] if num_classes <= len(CLASSES) else None
    return model.eval()


class SlowWorker(ModelWorker):
    """A ModelWorker whose classifier takes `delay` seconds longer per batch (set it at any time)."""

    delay = 0.0

    def classify(self, inputs):
        time.sleep(self.delay)
        return super().classify(inputs)


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def png(size=(40, 30), color=(200, 30, 30), mode="RGB") -> bytes:
    return encoded(Image.new(mode, size, color))


def photo(name: str = "china.jpg") -> bytes:
    return (PHOTOS / name).read_bytes()


def wait_ready(get, timeout: float = 120.0) -> None:
    """Poll GET /v2/health/ready through `get` until 200 (a first run may build the CPU operators first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if get("/v2/health/ready").status_code == 200:
                return
        time.sleep(0.02)
    raise TimeoutError("the server did not become ready")


@contextlib.contextmanager
def running_server(worker: ModelWorker, settings: ServeSettings | None = None) -> Iterator[str]:
    """A real uvicorn server for `worker` on a free loopback port, in a thread; yields its base URL once
    ready."""
    app = create_app(worker, settings or ServeSettings())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            wait_ready(client.get)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
