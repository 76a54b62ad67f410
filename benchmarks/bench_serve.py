"""`vitkit serve` under load: 1,000 requests on loopback from 1, 4 and 16 concurrent clients, against the
model's offline throughput at batch 16 measured in the same run.

    flock /tmp/vitkit-cpu.lock .venv/bin/python benchmarks/bench_serve.py --demo runs/demo/best \\
        --json benchmarks/results/serve_CPU_DATE.json
    .venv/bin/python benchmarks/bench_serve.py --table benchmarks/results/serve_CPU_DATE.json
        # the docs' table

For each model (the `demo` checkpoint, and ViT-S/16 with random weights: its speed is the architecture's), it
measures offline, in this process: the model alone (vitkit.optimize fp32, the server's path) on a batch of 16
preprocessed images, and the whole pipeline (decode, preprocess, model) for 16 images. Then it starts `vitkit
serve` in a process of its own and sends POST /predictions with one image: for the demo model a Fashion-MNIST
test image (28x28 PNG), for ViT-S/16 a 224x224 JPEG of scikit-learn's china.jpg. The demo model is also served
with --max-batch-size 1, the same server without batching. The server and the offline measurement use the
same number of PyTorch threads (--threads, default 1). Reported per cell: requests per second, p50 and p99
latency, errors (any answer but 200), and the mean batch size from the server's /metrics.

The load generator is a small HTTP/1.1 keep-alive client on asyncio streams, one connection per client, so
that it takes as little as it can of the CPU the server needs (client and server share the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import io
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from PIL import Image

import vitkit
from vitkit.cpu.allocator import retain_freed_memory
from vitkit.data.images import decode_image
from vitkit.data.transforms import build_eval_transform
from vitkit.inference import optimize

CONCURRENCY = (1, 4, 16)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return re.search(r"Model name:\s*(.+)", out).group(1).strip()
    except (OSError, subprocess.CalledProcessError, AttributeError):
        return platform.processor() or "unknown"


def demo_image() -> bytes:
    from vitkit.data import resolve

    test = resolve("fashion-mnist", "test")
    out = io.BytesIO()
    Image.fromarray(test.images[0, 0].numpy(), mode="L").save(out, format="PNG")
    return out.getvalue()


def photo_224() -> bytes:
    import sklearn

    im = Image.open(Path(sklearn.__file__).parent / "datasets" / "images" / "china.jpg").convert("RGB")
    side = min(im.size)
    im = im.crop(((im.width - side) // 2, (im.height - side) // 2,
                  (im.width + side) // 2, (im.height + side) // 2))
    out = io.BytesIO()
    im.resize((224, 224), Image.Resampling.BICUBIC).save(out, format="JPEG", quality=90)
    return out.getvalue()


# --- offline ----------------------------------------------------------------------------------------------
def offline(model_path: str, image: bytes, batch: int = 16, seconds: float = 10.0) -> dict:
    """Images per second at `batch`: the model alone on preprocessed inputs, and decode + preprocess +
    model."""
    model = vitkit.load(model_path)
    net = optimize(model, precision="fp32")
    transform = build_eval_transform(model.cfg)
    mode = "L" if model.cfg.in_chans == 1 else "RGB"
    x = torch.stack([transform(decode_image(image, mode))] * batch)

    def model_only():
        with torch.no_grad():
            net(x)

    def pipeline():
        xs = torch.stack([transform(decode_image(image, mode)) for _ in range(batch)])
        with torch.no_grad():
            net(xs).softmax(-1)

    out = {}
    for name, fn in (("model_img_s", model_only), ("pipeline_img_s", pipeline)):
        for _ in range(3):
            fn()
        times = []
        start = time.perf_counter()
        while time.perf_counter() - start < seconds or len(times) < 5:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = round(batch / statistics.median(times), 1)
    return out


# --- the server and its load --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start_server(model_path: str, max_batch_size: int,
                 args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "vitkit.cli.main", "serve", model_path, "--port", str(port),
           "--name", "bench", "--max-batch-size", str(max_batch_size),
           "--max-delay-ms", str(args.max_delay_ms),
           "--queue-size", "256", "--log-level", "warning", "--threads", str(args.threads)]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if get(url + "/v2/health/ready")[0] == 200:
                return proc, url
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"vitkit serve exited with {proc.returncode}: {' '.join(cmd)}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("vitkit serve did not become ready in 120 s")


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=60)


async def load(port: int, image: bytes, requests: int, clients: int) -> dict:
    """`requests` POST /predictions from `clients` keep-alive connections; throughput and latencies."""
    head = (f"POST /predictions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Content-Type: application/octet-stream\r\n"
            f"Content-Length: {len(image)}\r\n\r\n").encode()
    message = head + image
    left = requests
    latencies: list[float] = []
    errors: dict[str, int] = {}

    async def client():
        nonlocal left
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while left > 0:
            left -= 1
            t0 = time.perf_counter()
            writer.write(message)
            status = int((await reader.readline()).split()[1])
            length, close = 0, False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                key, _, value = line.decode().partition(":")
                if key.lower() == "content-length":
                    length = int(value)
                elif key.lower() == "connection" and value.strip().lower() == "close":
                    close = True
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - t0)
            if status != 200:
                errors[str(status)] = errors.get(str(status), 0) + 1
            if close:
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - start
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {"clients": clients, "requests": len(latencies), "seconds": round(elapsed, 2),
            "req_s": round(len(latencies) / elapsed, 1), "p50_ms": round(q[49] * 1000, 2),
            "p99_ms": round(q[98] * 1000, 2), "errors": sum(errors.values()), "errors_by_status": errors}


def batch_stats(url: str) -> tuple[float, float]:
    """The server's vitkit_batch_size count and sum so far."""
    text = get(url + "/metrics")[1].decode()
    count = float(re.search(r"^vitkit_batch_size_count (\S+)", text, re.M).group(1))
    total = float(re.search(r"^vitkit_batch_size_sum (\S+)", text, re.M).group(1))
    return count, total


def serve_runs(model_path: str, image: bytes, max_batch_size: int, args: argparse.Namespace) -> list[dict]:
    proc, url = start_server(model_path, max_batch_size, args)
    port = int(url.rsplit(":", 1)[1])
    rows = []
    try:
        asyncio.run(load(port, image, 50, 4))  # warm-up: threads, allocator, connections
        for clients in CONCURRENCY:
            before = batch_stats(url)
            row = asyncio.run(load(port, image, args.requests, clients))
            after = batch_stats(url)
            batches = after[0] - before[0]
            row["mean_batch"] = round((after[1] - before[1]) / batches, 2) if batches else None
            row["max_batch_size"] = max_batch_size
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        code = stop_server(proc)
    if code != 0:
        raise RuntimeError(f"vitkit serve exited with {code} after SIGTERM")
    return rows


def markdown_table(result: dict) -> str:
    """The results as the table of docs/serving.md."""
    lines = ["| model | server | clients | requests/s | p50 ms | p99 ms | errors | mean batch |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, entry in result["models"].items():
        for r in entry["serve"]:
            lines.append(f"| {name} | --max-batch-size {r['max_batch_size']} | {r['clients']} | "
                         f"{r['req_s']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['errors']} | "
                         f"{r['mean_batch']:.2f} |")
    lines.append("")
    lines.append("| model | offline batch 16, model alone (img/s) | offline batch 16, decode + preprocess + "
                 "model (img/s) | 16 clients / model alone | 16 clients / decode + model | 16 clients / "
                 "--max-batch-size 1 |")
    lines.append("|---|---:|---:|---:|---:|---:|")
    for name, e in result["models"].items():
        off = e["offline_batch16"]
        unbatched = e.get("ratio_16_clients_to_max_batch_size_1")
        lines.append(f"| {name} | {off['model_img_s']:.1f} | {off['pipeline_img_s']:.1f} | "
                     f"{e['ratio_16_clients_to_offline_model']:.2f}x | "
                     f"{e['ratio_16_clients_to_offline_pipeline']:.2f}x "
                     f"| {'-' if unbatched is None else f'{unbatched:.2f}x'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", type=Path, help="Only print the markdown table of an earlier run's JSON.")
    parser.add_argument("--demo", help="The demo checkpoint (make demo: runs/demo/best).")
    parser.add_argument("--requests", type=int, default=1000, help="Requests per cell.")
    parser.add_argument("--max-delay-ms", type=float, default=10.0, help="The server's --max-delay-ms.")
    parser.add_argument("--threads", type=int, default=1,
                        help="PyTorch threads of the server and of the offline measurement alike (default 1: "
                             "the load generator needs a core of its own on a 2-core machine).")
    parser.add_argument("--skip-vit-s", action="store_true", help="Only the demo model.")
    parser.add_argument("--json", type=Path, help="Write the results here.")
    args = parser.parse_args()
    if args.table:
        print(markdown_table(json.loads(args.table.read_text())))
        return
    if not args.demo:
        parser.error("--demo is needed (the demo checkpoint, e.g. runs/demo/best)")
    retain_freed_memory()
    torch.set_num_threads(args.threads)
    result = {"what": "vitkit serve: POST /predictions on loopback, 1,000 requests per cell",
              "cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
              "date": datetime.date.today().isoformat(), "command": " ".join([Path(sys.argv[0]).as_posix(),
                                                                              *sys.argv[1:]]),
              "torch": torch.__version__, "python": platform.python_version(),
              "load_average_before": os.getloadavg(), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        models = {"demo": (args.demo, demo_image(), (16, 1))}
        if not args.skip_vit_s:
            vit_s = Path(tmp) / "vit-s16"
            vitkit.save(vitkit.create_model("ViT-S/16"), vit_s)
            models["ViT-S/16"] = (str(vit_s), photo_224(), (16,))
        for name, (path, image, batch_sizes) in models.items():
            entry = {"image_bytes": len(image), "offline_batch16": offline(path, image)}
            print(name, json.dumps(entry), flush=True)
            entry["serve"] = [row for mbs in batch_sizes for row in serve_runs(path, image, mbs, args)]
            at16 = next(r for r in entry["serve"] if r["clients"] == 16 and r["max_batch_size"] == 16)
            entry["ratio_16_clients_to_offline_model"] = round(
                at16["req_s"] / entry["offline_batch16"]["model_img_s"], 3)
            entry["ratio_16_clients_to_offline_pipeline"] = round(
                at16["req_s"] / entry["offline_batch16"]["pipeline_img_s"], 3)
            unbatched = [r for r in entry["serve"] if r["clients"] == 16 and r["max_batch_size"] == 1]
            if unbatched:
                entry["ratio_16_clients_to_max_batch_size_1"] = round(
                    at16["req_s"] / unbatched[0]["req_s"], 3)
            result["models"][name] = entry
    result["load_average_after"] = os.getloadavg()
    print(markdown_table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
