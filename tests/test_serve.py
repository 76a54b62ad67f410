"""vitkit serve's HTTP API: through the ASGI test client, and with httpx against a real uvicorn server on a
free loopback port (batching across concurrent clients, a full queue, timeouts, clients that go away), and the
`vitkit serve` command itself, stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib

import pytest

pytest.importorskip("starlette", reason="vitkit serve needs the serve extra: pip install 'vitkit[serve]'")
httpx = pytest.importorskip("httpx", reason="the serve tests drive the server with httpx (the dev extra)")

import torch  # noqa: E402
from PIL import Image  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

import vitkit  # noqa: E402
from serve_helpers import (  # noqa: E402
    CLASSES,
    SlowWorker,
    photo,
    png,
    running_server,
    tiny_model,
    wait_ready,
)
from vitkit.data.transforms import build_eval_transform  # noqa: E402
from vitkit.serve import ModelWorker, ServeSettings, create_app  # noqa: E402
from vitkit.train.predict import predict  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model()


@pytest.fixture(scope="module")
def client(model):
    app = create_app(ModelWorker(vitkit.optimize(model), "tiny"), ServeSettings(max_body_bytes=1_000_000))
    with TestClient(app) as c:
        wait_ready(c.get)
        yield c


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def infer_body(name: str, datatype: str, shape, data, **extra) -> dict:
    return {"inputs": [{"name": name, "datatype": datatype, "shape": shape, "data": data}], **extra}


def metric(text: str, name: str, **labels) -> float:
    """One sample's value from Prometheus's text format."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "") + r" (\S+)"
    match = re.search(pattern, text)
    return float(match.group(1)) if match else 0.0


# --- what a client gets -----------------------------------------------------------------------------------
def test_predictions_are_those_of_vitkit_predict(client, model, tmp_path):
    path = tmp_path / "china.jpg"
    path.write_bytes(photo())
    (expected,), _ = predict(model, [path], top_k=3)
    raw = client.post("/predictions?top_k=3", content=photo(), headers={"Content-Type": "image/jpeg"})
    form = client.post("/predictions", params={"top_k": 3},
                       files={"file": ("china.jpg", photo(), "image/jpeg")})
    assert raw.status_code == form.status_code == 200
    assert raw.json() == form.json()
    assert [p["label"] for p in raw.json()] == expected.labels
    assert [p["score"] for p in raw.json()] == pytest.approx(expected.probs, abs=1e-4)


def test_top_k_defaults_to_five_and_stops_at_the_number_of_classes(client):
    assert len(client.post("/predictions", content=png()).json()) == 5
    everything = client.post("/predictions?top_k=100", content=png()).json()
    assert sorted(p["label"] for p in everything) == sorted(CLASSES)
    assert sum(p["score"] for p in everything) == pytest.approx(1.0, abs=1e-5)
    scores = [p["score"] for p in everything]
    assert scores == sorted(scores, reverse=True)


def test_open_inference_protocol_metadata_and_inference(client, model):
    meta = client.get("/v2/models/tiny").json()
    assert meta["name"] == "tiny"
    assert {i["name"]: (i["datatype"], i["shape"]) for i in meta["inputs"]} == {
        "image": ("BYTES", [-1]), "pixel_values": ("FP32", [-1, 3, 32, 32])}
    assert [o["name"] for o in meta["outputs"]] == ["probabilities", "labels"]
    assert meta["parameters"]["labels"] == CLASSES

    images = [photo("china.jpg"), photo("flower.jpg")]
    by_bytes = client.post("/v2/models/tiny/infer",
                           json=infer_body("image", "BYTES", [2], [b64(i) for i in images],
                                           id="r1", parameters={"top_k": 2}))
    assert by_bytes.status_code == 200, by_bytes.text
    out = {o["name"]: o for o in by_bytes.json()["outputs"]}
    assert by_bytes.json()["id"] == "r1"
    assert out["probabilities"]["shape"] == [2, len(CLASSES)] and out["labels"]["shape"] == [2, 2]
    probs = torch.tensor(out["probabilities"]["data"]).view(2, -1)

    transform = build_eval_transform(model.cfg)
    x = torch.stack([transform(Image.open(io.BytesIO(i)).convert("RGB")) for i in images])
    with torch.no_grad():
        assert probs == pytest.approx(model(x).softmax(-1), abs=1e-4)
    assert out["labels"]["data"][0] == CLASSES[int(probs[0].argmax())]
    by_tensor = client.post("/v2/models/tiny/infer", json=infer_body("pixel_values", "FP32", [2, 3, 32, 32],
                                                                     x.flatten().tolist(),
                                                                     outputs=[{"name": "probabilities"}]))
    assert by_tensor.status_code == 200, by_tensor.text
    (only,) = by_tensor.json()["outputs"]
    assert only["name"] == "probabilities"
    assert torch.tensor(only["data"]).view(2, -1) == pytest.approx(probs, abs=1e-5)


def test_attention_answers_the_overlay_as_png(client, model):
    r = client.post("/attention", files={"file": ("flower.jpg", photo("flower.jpg"), "image/jpeg")})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    overlay = Image.open(io.BytesIO(r.content))
    assert overlay.format == "PNG" and overlay.size == (224, 224) and overlay.mode == "RGB"
    assert 0 < max(overlay.getextrema()[0]) <= 255  # the image, weighted by a map whose maximum is 1


def test_a_grey_model_takes_colour_photographs():
    app = create_app(ModelWorker(tiny_model(in_chans=1, image_size=28, patch_size=7), "grey"))
    with TestClient(app) as c:
        wait_ready(c.get)
        assert c.post("/predictions", content=photo()).status_code == 200
        assert c.post("/attention", content=png(mode="L", color=90)).status_code == 200


def test_health_ready_only_after_the_model_has_run():
    worker = SlowWorker(tiny_model(), "tiny")
    worker.delay = 0.5  # the warm-up's first run takes this long
    with TestClient(create_app(worker)) as c:
        assert c.get("/v2/health/live").status_code == 200
        assert c.get("/v2/health/ready").status_code == 503
        assert c.get("/v2/models/tiny/ready").json() == {"name": "tiny", "ready": False}
        wait_ready(c.get)
        assert c.get("/v2/models/tiny/ready").status_code == 200


def test_ready_only_after_every_batch_size_has_run():
    """The warm-up runs each batch size the batchers can form through the classifier and the attention
    maps (vitkit's kernels time their candidates at the first call of each shape: never on a request's
    path), one overlay picture, and says how long it took."""
    seen: dict[str, list[int]] = {"classify": [], "attention_maps": []}
    said: list[str] = []

    class Recording(ModelWorker):
        def classify(self, inputs):
            seen["classify"].append(len(inputs))
            return super().classify(inputs)

        def attention_maps(self, x):
            seen["attention_maps"].append(len(x))
            return super().attention_maps(x)

    worker = Recording(vitkit.optimize(tiny_model()), "tiny")
    worker.on_ready = said.append
    gc.unfreeze()
    with TestClient(create_app(worker, ServeSettings(max_batch_size=5))) as c:
        wait_ready(c.get)
        assert seen == {"classify": [1, 2, 3, 4, 5], "attention_maps": [1, 1, 2, 3, 4, 5]}  # an overlay first
        # what lives as long as the server leaves the garbage collector's full collections (a GIL stall each)
        assert gc.get_freeze_count() > 10_000
        assert len(said) == 1 and re.fullmatch(r"ready: warmed up batches of 1 to 5 in \d+\.\d s", said[0])


def test_a_lone_request_does_not_wait_for_batch_mates(model):
    """With nothing else in flight a request runs at once, however long --max-delay-ms is."""
    app = create_app(ModelWorker(model, "tiny"), ServeSettings(max_delay_ms=5000))
    with TestClient(app) as c:
        wait_ready(c.get)
        start = time.monotonic()
        assert c.post("/predictions", content=png()).status_code == 200
        assert time.monotonic() - start < 2.0


def test_the_page_has_an_icon(client):
    """Browsers ask for /favicon.ico: an ICO Pillow reads, at 16 and 32 pixels, and the page links it."""
    r = client.get("/favicon.ico")
    assert r.status_code == 200 and r.headers["content-type"] == "image/x-icon"
    icon = Image.open(io.BytesIO(r.content))
    assert icon.format == "ICO" and icon.info["sizes"] == {(16, 16), (32, 32)}
    assert '<link rel="icon" href="favicon.ico">' in client.get("/").text


def test_the_page_is_served_without_outside_resources(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<title>vitkit serve: tiny</title>" in r.text
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", r.text)  # nothing fetched from elsewhere


def test_metrics_count_requests_by_status(client):
    client.post("/predictions", content=b"not an image")
    text = client.get("/metrics").text
    assert metric(text, "vitkit_requests_total", endpoint="/predictions", status="415") >= 1
    assert metric(text, "vitkit_batch_size_count") >= 1
    assert "vitkit_queue_time_seconds_bucket" in text and "vitkit_request_latency_seconds_bucket" in text


# --- bad input: a JSON error saying what is wrong, and the server goes on -----------------------------------
def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A 1x1 PNG whose header claims width x height pixels: a decompression bomb as its header shows it."""
    data = bytearray(png((1, 1)))
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(data)


CORRUPT_JPEG = photo()[:5000]  # cut off in the middle of its entropy-coded data


@pytest.mark.parametrize("body, headers, status, message", [
    (b"", {}, 400, "empty"),
    (b"%PDF-1.7 not an image at all", {"Content-Type": "image/png"}, 415, "not an image"),
    (png((64, 64))[:60], {"Content-Type": "image/png"}, 422, "corrupt or truncated"),
    (CORRUPT_JPEG, {"Content-Type": "image/jpeg"}, 422, "corrupt or truncated"),
    (bomb_png(), {}, 413, "decompression bomb"),
    (bomb_png(10_000, 9_000), {}, 413, "decompression bomb"),
    (bytes(1_200_000), {}, 413, "more than the server's limit of 1,000,000"),
], ids=["empty", "not-an-image", "truncated-png", "truncated-jpeg", "pixel-bomb",
        "pixel-bomb-below-pillows-own-limit", "over-byte-cap"])
def test_bad_images_get_the_status_that_says_why(client, body, headers, status, message):
    r = client.post("/predictions", content=body, headers=headers)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    assert client.post("/predictions", content=png()).status_code == 200  # and the server goes on


def test_the_byte_cap_holds_without_content_length(client):
    def chunks():  # sent chunked: the size is known only as it is read
        for _ in range(30):
            yield bytes(50_000)

    r = client.post("/attention", content=chunks())
    assert r.status_code == 413 and "at least" in r.json()["error"]


def test_the_pixel_cap_is_the_servers():
    app = create_app(ModelWorker(tiny_model(), "tiny", max_pixels=1000))
    with TestClient(app) as c:
        r = c.post("/predictions", content=png((40, 30)))
        assert r.status_code == 413 and "1,000" in r.json()["error"]
        assert c.post("/predictions", content=png((20, 20))).status_code == 200


@pytest.mark.parametrize("body, message", [
    (infer_body("pixel_values", "FP32", [1, 3, 32, 31], [0.0] * 2976),
     "shape [1, 3, 32, 31]; this model takes FP32 of shape [N, 3, 32, 32]"),
    (infer_body("pixel_values", "FP64", [1, 3, 32, 32], [0.0] * 3072),
     "datatype 'FP64'; this model takes FP32"),
    (infer_body("pixel_values", "FP32", [1, 3, 32, 32], [0.0] * 100), "100 values for shape [1, 3, 32, 32]"),
    (infer_body("pixel_values", "FP32", [1, 3, 32, 32], ["a"] * 3072), "not an array of numbers"),
    (infer_body("image", "BYTES", [1], ["@@not base64@@"]), "not valid base64"),
    (infer_body("image", "FP32", [1], [b64(png())]), "it is BYTES"),
    (infer_body("logits", "FP32", [1], [0.0]), "unknown input 'logits'"),
    ({"inputs": []}, "0 inputs"),
    (infer_body("image", "BYTES", [1], [b64(png())], outputs=[{"name": "features"}]), "unknown outputs"),
    (infer_body("image", "BYTES", [1], [b64(png())], parameters={"top_k": 0}), "top_k=0"),
], ids=["shape", "dtype", "count", "not-numbers", "base64", "datatype-of-image", "unknown-input", "no-input",
        "unknown-output", "top-k"])
def test_wrong_inference_requests_get_400_naming_what_is_expected(client, body, message):
    r = client.post("/v2/models/tiny/infer", json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]


def test_other_wrong_requests(client):
    assert client.post("/v2/models/tiny/infer",
                       content=b"{nope").json()["error"].startswith("the body is not JSON")
    r = client.post("/v2/models/other/infer", json={})
    assert r.status_code == 404 and "serves 'tiny'" in r.json()["error"]
    r = client.post("/predictions?top_k=zero", content=png())
    assert r.status_code == 400 and "top_k='zero'" in r.json()["error"]
    r = client.post("/predictions", files={"image": ("x.png", png(), "image/png")})
    assert r.status_code == 400 and "no file part named 'file'" in r.json()["error"]
    r = client.post("/v2/models/tiny/infer", json=infer_body("image", "BYTES", [1], [b64(b"text")]))
    assert r.status_code == 415 and "input 'image'[0]" in r.json()["error"]
    assert client.get("/nowhere").status_code == 404 and "error" in client.get("/nowhere").json()


def test_the_token(model):
    app = create_app(ModelWorker(model, "tiny"), ServeSettings(token="s3cret"))
    with TestClient(app) as c:
        wait_ready(c.get)  # the health probes, the page and its icon need no token
        assert c.get("/").status_code == 200 and c.get("/favicon.ico").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = c.post("/predictions", content=png(), headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert "Authorization: Bearer" in r.json()["error"]
        assert c.get("/metrics").status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert c.post("/predictions", content=png(), headers=ok).status_code == 200
        assert c.get("/metrics", headers=ok).status_code == 200


# --- a real server on loopback ------------------------------------------------------------------------------
async def post_many(url: str, n: int, path: str = "/predictions", timeout: float = 10.0) -> list:
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as c:
        return await asyncio.gather(*(c.post(path, content=png()) for _ in range(n)), return_exceptions=True)


def test_concurrent_requests_are_batched(model):
    worker = SlowWorker(vitkit.optimize(model), "tiny")
    with running_server(worker, ServeSettings(max_batch_size=16, max_delay_ms=20)) as url:
        worker.delay = 0.05  # while one batch runs, the next fills
        answers = asyncio.run(post_many(url, 24))
        assert [a.status_code for a in answers] == [200] * 24
        text = httpx.get(f"{url}/metrics").text
    batches, images = metric(text, "vitkit_batch_size_count"), metric(text, "vitkit_batch_size_sum")
    assert images == 24 + 0 and batches < 24  # the warm-up runs outside the batchers
    assert metric(text, "vitkit_batch_size_bucket", le="1.0") < batches  # some batch held more than one image


def test_a_full_queue_answers_503_with_retry_after_at_once(model):
    worker = SlowWorker(model, "tiny")
    with running_server(worker, ServeSettings(max_batch_size=1, max_delay_ms=0, queue_size=2)) as url:
        worker.delay = 1.0

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=10) as c:
                first = asyncio.ensure_future(c.post("/predictions", content=png()))
                await asyncio.sleep(0.2)  # running now, for a second; two more fill the queue
                queued = [asyncio.ensure_future(c.post("/predictions", content=png())) for _ in range(2)]
                await asyncio.sleep(0.2)
                start = time.monotonic()
                refused = await c.post("/predictions", content=png())
                return refused, time.monotonic() - start, await asyncio.gather(first, *queued)

        refused, seconds, served = asyncio.run(main())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "busy" in refused.json()["error"] and seconds < 0.5  # not after the running batch
    assert [r.status_code for r in served] == [200, 200, 200]


def test_a_failure_answers_500_with_an_id_and_logs_the_exception_under_it(model, caplog):
    """The client gets an id to quote, never the exception's text; the server's log has both."""

    class Failing(ModelWorker):
        armed = False  # after the warm-up

        def classify(self, inputs):
            if self.armed:
                raise RuntimeError("secret internal detail /srv/models/x")
            return super().classify(inputs)

    worker = Failing(model, "tiny")
    with TestClient(create_app(worker, ServeSettings()), raise_server_exceptions=False) as c:
        wait_ready(c.get)
        worker.armed = True
        with caplog.at_level("ERROR", logger="vitkit.serve"):
            r = c.post("/predictions", content=png())
    assert r.status_code == 500
    body = r.json()
    assert "secret" not in r.text and body["error_id"] in body["error"]
    logged = [rec for rec in caplog.records if body["error_id"] in rec.getMessage()]
    assert logged and "secret internal detail" in str(logged[0].exc_info[1])


def test_a_request_larger_than_the_queue_answers_413_naming_the_limit_even_when_idle(model):
    """Retrying could never help such a request: 413 at once, not 503 'retry later'."""
    worker = SlowWorker(model, "tiny")
    with running_server(worker, ServeSettings(max_batch_size=2, queue_size=2)) as url:
        body = infer_body("image", "BYTES", [3], [b64(png())] * 3)
        r = httpx.post(f"{url}/v2/models/tiny/infer", json=body, timeout=10)
        assert r.status_code == 413 and "retry-after" not in r.headers
        assert "at most 2 images a request" in r.json()["error"] and "--queue-size" in r.json()["error"]
        two = infer_body("image", "BYTES", [2], [b64(png())] * 2)
        ok = httpx.post(f"{url}/v2/models/tiny/infer", json=two, timeout=10)
        assert ok.status_code == 200


def test_a_request_past_its_timeout_answers_504_and_the_server_goes_on(model):
    worker = SlowWorker(model, "tiny")
    with running_server(worker, ServeSettings(timeout_s=0.3, max_delay_ms=0)) as url:
        worker.delay = 0.8
        r = httpx.post(f"{url}/predictions", content=png(), timeout=5)
        assert r.status_code == 504 and "0.3 s" in r.json()["error"]
        worker.delay = 0.0
        time.sleep(0.6)  # the abandoned batch ends
        assert httpx.post(f"{url}/predictions", content=png(), timeout=5).status_code == 200


def test_a_client_that_goes_away_breaks_neither_its_batch_nor_the_next(model):
    worker = SlowWorker(model, "tiny")
    with running_server(worker, ServeSettings(max_batch_size=8, max_delay_ms=100)) as url:
        worker.delay = 0.4

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=10) as patient, \
                       httpx.AsyncClient(base_url=url, timeout=0.2) as impatient:
                gone = asyncio.ensure_future(impatient.post("/predictions", content=png()))
                stay = [asyncio.ensure_future(patient.post("/predictions", content=png())) for _ in range(3)]
                return await asyncio.gather(gone, *stay, return_exceptions=True)

        gone, *stayed = asyncio.run(main())
        assert isinstance(gone, httpx.TimeoutException)
        assert [r.status_code for r in stayed] == [200, 200, 200]
        worker.delay = 0.0
        assert [r.status_code for r in asyncio.run(post_many(url, 4))] == [200] * 4


def test_the_byte_cap_on_a_real_server(model):
    with running_server(ModelWorker(model, "tiny"), ServeSettings(max_body_bytes=50_000)) as url:
        r = httpx.post(f"{url}/predictions", content=bytes(60_000))
        assert r.status_code == 413
        assert httpx.post(f"{url}/predictions", content=png()).status_code == 200


def test_a_client_still_sending_an_over_size_body_reads_the_413(model):
    """urllib sends the whole body before it reads an answer: the server reads and drops the rest of a body
    it refuses (by Content-Length, or as a chunked body grows past the cap), so the client gets the 413, not a
    reset connection. curl and httpx see it either way."""
    import urllib.error
    import urllib.request

    def chunks():
        for _ in range(40):
            yield bytes(500_000)

    with running_server(ModelWorker(model, "tiny"), ServeSettings(max_body_bytes=1_000_000)) as url:
        for body in (bytes(20_000_000), chunks()):  # 20 MB with a length; chunked (no length) 20 MB
            request = urllib.request.Request(f"{url}/predictions", data=body, method="POST")
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(request, timeout=30)
            assert info.value.code == 413 and "vitkit serve --max-body-mb" in info.value.read().decode()
        assert httpx.post(f"{url}/predictions", content=png()).status_code == 200


# --- the command --------------------------------------------------------------------------------------------
def test_vitkit_serve_drains_on_sigterm_and_exits_0(model, tmp_path):
    """Two requests are in flight when SIGTERM comes, one still sending its body and one queued, waiting for
    it as a batch-mate: both are answered, a new request gets 503, and the command exits 0."""
    vitkit.save(model, tmp_path / "tiny", class_names=CLASSES)
    proc = subprocess.Popen([sys.executable, "-m", "vitkit.cli.main", "serve", str(tmp_path / "tiny"),
                             "--port", "0", "--max-delay-ms", "1500", "--max-batch-size", "8"],
                            stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stderr:
            # vitkit's own line names the port the system chose for --port 0
            match = re.search(r"^serving tiny .* at (http://127\.0\.0\.1:(\d+))/", line)
            if match:
                assert match.group(2) != "0"
                url = match.group(1)
                break
        assert url, "the server did not say where it listens"
        # the rest of its log, never blocking it
        log: list[str] = []
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
        wait_ready(lambda path: httpx.get(url + path))
        for _ in range(100):  # said just as it became ready
            if any(line.startswith("ready: warmed up batches of 1 to 8 in ") for line in log):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the server did not say it warmed up: {log}")
        assert httpx.get(url + "/v2/models/tiny").json()["parameters"]["labels"] == CLASSES

        async def slow_body():
            data = png()
            yield data[:20]
            await asyncio.sleep(1.0)  # in flight all along, sending its body
            yield data[20:]

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=10) as c:
                uploading = asyncio.ensure_future(c.post("/predictions", content=slow_body()))
                await asyncio.sleep(0.2)
                waiting = asyncio.ensure_future(c.post("/predictions", content=photo()))
                await asyncio.sleep(0.3)  # queued for its batch: its batch-mate is still on its way
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                async with httpx.AsyncClient(base_url=url, timeout=10) as late:
                    refused = await late.post("/predictions", content=png())
                    not_ready = await late.get("/v2/health/ready")
                return await waiting, await uploading, refused, not_ready

        answered, uploaded, refused, not_ready = asyncio.run(main())
        assert answered.status_code == uploaded.status_code == 200 and len(answered.json()) == 5
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]
        assert not_ready.status_code == 503
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
