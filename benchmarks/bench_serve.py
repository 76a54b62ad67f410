"""`vitkit serve` against the serving frameworks a user would pick instead, LitServe and mosec, on the same
model, preprocessing, batching and load (benchmarks/serve_anchors.py serves the model behind them).

    pip install 'vitkit[bench-serve]'        # litserve, mosec: for this benchmark only
    flock /tmp/vitkit-cpu.lock .venv/bin/python benchmarks/bench_serve.py --demo runs/demo/best \\
        --json benchmarks/results/serve_CPU_DATE.json
    .venv/bin/python benchmarks/bench_serve.py --table benchmarks/results/serve_CPU_DATE.json  # docs' table

Models: the `demo` checkpoint with a 28x28 Fashion-MNIST test PNG, and ViT-S/16 (random weights: its speed
is the architecture's) with a 224x224 JPEG of scikit-learn's china.jpg. Every server runs `vitkit.optimize`
(fp32) on --threads PyTorch threads, vitkit's decoder and evaluation transform, batches of up to 16 requests
waiting at most 10 ms, and answers the top 5 labels as JSON. Each request is a POST of a multipart form with
the image as its `file` field (what `curl -F file=@image.png` sends), from 1, 4, 16 and 64 clients, each on
its own keep-alive connection. Per cell: requests per second, p50 and p99 latency, errors (any answer but
200), and the CPU time of the server's processes per request (user + system, from /proc, all its processes).
A cell lasts at least --seconds (and --requests); the servers run one at a time, in a shuffled order, --rounds
times; the table gives each cell's median over the rounds.

The load generator is a small HTTP/1.1 client on asyncio streams, so that it takes as little as it can of the
CPU the server needs (client and server share the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import io
import json
import os
import platform
import random
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from render_tables import SERVE_CONCURRENCY as CONCURRENCY  # noqa: E402
from render_tables import SERVERS, serve_table  # noqa: E402

PATHS = {"vitkit": "/predictions", "litserve": "/predict", "mosec": "/inference"}
BOUNDARY = "vitkitbenchboundary"
HERE = Path(__file__).resolve().parent


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


def multipart(image: bytes, filename: str) -> bytes:
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode() + image \
        + f"\r\n--{BOUNDARY}--\r\n".encode()


# --- the servers --------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(server: str, model: str, port: int, args: argparse.Namespace) -> list[str]:
    if server == "vitkit":
        return [sys.executable, "-m", "vitkit.cli.main", "serve", model, "--port", str(port),
                "--name", "bench", "--max-batch-size", "16", "--max-delay-ms", str(args.max_delay_ms),
                "--queue-size", "256", "--log-level", "warning", "--threads", str(args.threads),
                "--workers", str(args.processes)]
    return [sys.executable, str(HERE / "serve_anchors.py"), server, model, "--port", str(port),
            "--threads", str(args.threads), "--max-batch-size", "16",
            "--max-delay-ms", str(args.max_delay_ms), "--processes", str(args.processes)]


def process_tree(root: int) -> list[int]:
    """`root` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def cpu_seconds(root: int) -> float:
    """User + system CPU seconds of `root`'s processes so far."""
    ticks = 0
    for pid in process_tree(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


async def post_once(port: int, message: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(message)
        return (await read_answer(reader))[0]
    finally:
        writer.close()


def ready(server: str, port: int) -> bool:
    """vitkit serve's own readiness (its warm-up done: requests sent before it queue behind the warm-up and
    would be timed with it); the anchors warm up before they answer at all."""
    if server != "vitkit":
        return True
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5) as r:
            return r.status == 200
    except OSError:  # not listening yet, or 503 (HTTPError)
        return False


def start_server(server: str, model: str, message_for,
                 args: argparse.Namespace) -> tuple[subprocess.Popen, int]:
    """The server in a session of its own, once it is ready and has answered a real request 200."""
    port = free_port()
    cmd = server_command(server, model, port, args)
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if ready(server, port) and asyncio.run(post_once(port, message_for(port))) == 200:
                return proc, port
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError):
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{server} exited with {proc.returncode}: {' '.join(cmd)}")
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"{server} did not answer in 300 s: {' '.join(cmd)}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's whole session, then SIGKILL to what is left of it."""
    pids = process_tree(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=10)


# --- the load ---------------------------------------------------------------------------------------------
async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """An HTTP/1.1 answer's status, read whole (Content-Length or chunked); and whether the server closes."""
    status = int((await reader.readline()).split()[1])
    length, chunked, close = 0, False, False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        key, _, value = line.decode().partition(":")
        key, value = key.strip().lower(), value.strip().lower()
        if key == "content-length":
            length = int(value)
        elif key == "transfer-encoding" and "chunked" in value:
            chunked = True
        elif key == "connection" and value == "close":
            close = True
    if chunked:
        while (size := int((await reader.readline()).split(b";")[0], 16)) > 0:
            await reader.readexactly(size + 2)
        await reader.readline()
    else:
        await reader.readexactly(length)
    return status, close


async def load(port: int, message: bytes, requests: int, clients: int, seconds: float = 0.0) -> dict:
    """Requests from `clients` keep-alive connections, each sending its next as its last is answered, until
    `requests` have been sent and `seconds` have passed; throughput and latencies."""
    left = requests
    latencies: list[float] = []
    errors: dict[str, int] = {}
    until = time.perf_counter() + seconds

    async def client():
        nonlocal left
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while left > 0 or time.perf_counter() < until:
            left -= 1
            t0 = time.perf_counter()
            writer.write(message)
            status, close = await read_answer(reader)
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


def serve_cells(server: str, model: str, image: bytes, requests: int, seconds: float,
                args: argparse.Namespace) -> list[dict]:
    body = multipart(image, "image.png" if image[:4] == b"\x89PNG" else "image.jpg")

    def message(port: int) -> bytes:
        return (f"POST {PATHS[server]} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    proc, port = start_server(server, model, message, args)
    rows = []
    try:
        asyncio.run(load(port, message(port), 50, 4))  # threads, allocators, connections
        for clients in CONCURRENCY:
            cpu = cpu_seconds(proc.pid)
            row = asyncio.run(load(port, message(port), requests, clients, seconds))
            used = cpu_seconds(proc.pid) - cpu
            row["server_cpu_ms_per_request"] = round(1000 * used / row["requests"], 3)
            row["server"] = server
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        stop_server(proc)
    return rows


# --- the summary ------------------------------------------------------------------------------------------
def summarise(runs: list[dict]) -> list[dict]:
    """Each (server, clients) cell's median over the rounds; errors summed."""
    cells: dict[tuple[str, int], list[dict]] = {}
    for row in runs:
        cells.setdefault((row["server"], row["clients"]), []).append(row)
    out = []
    for (server, clients), rows in cells.items():
        out.append({"server": server, "clients": clients, "rounds": len(rows),
                    "errors": sum(r["errors"] for r in rows),
                    **{k: round(statistics.median(r[k] for r in rows), 2)
                       for k in ("req_s", "p50_ms", "p99_ms", "server_cpu_ms_per_request")}})
    return sorted(out, key=lambda c: (c["clients"], SERVERS.index(c["server"])))


def ratios(cells: list[dict]) -> list[dict]:
    """vitkit's requests/s over the best anchor's at each client count, with both p99s."""
    out = []
    for clients in CONCURRENCY:
        here = {c["server"]: c for c in cells if c["clients"] == clients}
        anchors = [c for name, c in here.items() if name != "vitkit"]
        if "vitkit" not in here or not anchors:
            continue
        best = max(anchors, key=lambda c: c["req_s"])
        out.append({"clients": clients, "best_anchor": best["server"],
                    "vitkit_over_best": round(here["vitkit"]["req_s"] / best["req_s"], 3),
                    "vitkit_p99_ms": here["vitkit"]["p99_ms"], "best_anchor_p99_ms": best["p99_ms"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", type=Path, help="Only print the markdown table of an earlier run's JSON.")
    parser.add_argument("--demo", help="The demo checkpoint (make demo: runs/demo/best).")
    parser.add_argument("--requests", type=int, default=500,
                        help="At least this many requests a cell, demo model.")
    parser.add_argument("--seconds", type=float, default=10.0, help="At least this long a cell, demo model.")
    parser.add_argument("--seconds-vit-s", type=float, default=30.0, help="The same for ViT-S/16.")
    parser.add_argument("--rounds", type=int, default=2, help="Times each server runs every cell.")
    parser.add_argument("--servers", default=",".join(SERVERS), help="Which servers (comma-separated).")
    parser.add_argument("--max-delay-ms", type=float, default=10.0, help="Every server's batch delay.")
    parser.add_argument("--threads", type=int, default=1,
                        help="PyTorch threads of every server's model (default 1: the load generator needs "
                             "a core of its own on a 2-core machine).")
    parser.add_argument("--processes", type=int, default=1,
                        help="Each server's processes: vitkit serve --workers; LitServe's API servers and "
                             "model workers; mosec's processes per stage (each with --threads threads).")
    parser.add_argument("--skip-vit-s", action="store_true", help="Only the demo model.")
    parser.add_argument("--seed", type=int, default=0, help="The shuffle of the servers' order.")
    parser.add_argument("--json", type=Path, help="Write the results here.")
    args = parser.parse_args()
    if args.table:
        print(serve_table(json.loads(args.table.read_text())))
        return
    if not args.demo:
        parser.error("--demo is needed (the demo checkpoint, e.g. runs/demo/best)")
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if unknown := set(servers) - set(SERVERS):
        parser.error(f"--servers: unknown {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    versions = {"torch": torch.__version__, "python": platform.python_version(), "vitkit": vitkit.__version__}
    for package in ("litserve", "mosec", "uvicorn", "starlette"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:  # noqa: BLE001 - not installed: the record says so
            versions[package] = None
    result = {"what": "POST a multipart image on loopback: vitkit serve, LitServe, mosec; the same model",
              "cpu": cpu_name(), "cores": os.cpu_count(), "threads": args.threads,
              "processes": args.processes,
              "date": datetime.date.today().isoformat(),
              "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "versions": versions,
              "load_average_before": os.getloadavg(), "models": {}}
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        models = {"demo": (args.demo, demo_image(), args.seconds)}
        if not args.skip_vit_s:
            vit_s = Path(tmp) / "vit-s16"
            vitkit.save(vitkit.create_model("ViT-S/16"), vit_s)
            models["ViT-S/16"] = (str(vit_s), photo_224(), args.seconds_vit_s)
        for name, (path, image, seconds) in models.items():
            runs = []
            for round_ in range(args.rounds):
                for server in rng.sample(servers, len(servers)):
                    print(f"{name}, round {round_ + 1}: {server}", flush=True)
                    requests = args.requests if name == "demo" else 0
                    rows = serve_cells(server, path, image, requests, seconds, args)
                    runs += [dict(r, round=round_ + 1) for r in rows]
            cells = summarise(runs)
            result["models"][name] = {"image_bytes": len(image), "seconds_per_cell": seconds, "runs": runs,
                                      "cells": cells, "ratios": ratios(cells)}
    result["load_average_after"] = os.getloadavg()
    print(serve_table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
