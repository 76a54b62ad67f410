"""`vitkit serve --workers 2`: two server processes on one port, the connections shared out between them, a
dead one replaced while the other answers, and SIGTERM draining both to exit 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="vitkit serve needs the serve extra: pip install 'vitkit[serve]'")
httpx = pytest.importorskip("httpx", reason="the serve tests drive the server with httpx (the dev extra)")

import vitkit  # noqa: E402
from serve_helpers import CLASSES, photo, tiny_model, wait_ready  # noqa: E402


def server_processes(supervisor: int) -> list[int]:
    """The supervisor's spawned server processes (not multiprocessing's resource tracker)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == supervisor and b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return found


def connections_on(pid: int, port: int) -> int:
    """The established TCP connections to local `port` that process `pid` holds (from /proc)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":  # 01: ESTABLISHED
            inodes.add(fields[9])
    held = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        held += target.startswith("socket:[") and target[8:-1] in inodes
    return held


def wait_for(log: list[str], pattern: str, seconds: float = 120.0) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for line in list(log):
            if re.search(pattern, line):
                return line
        time.sleep(0.05)
    raise AssertionError(f"the server did not say {pattern!r}: {log}")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the server processes from /proc")
def test_two_server_processes_share_the_port_and_one_that_dies_is_replaced(tmp_path):
    vitkit.save(tiny_model(), tmp_path / "tiny", class_names=CLASSES)
    proc = subprocess.Popen([sys.executable, "-m", "vitkit.cli.main", "serve", str(tmp_path / "tiny"),
                             "--port", "0", "--workers", "2", "--max-batch-size", "4",
                             "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    try:
        line = wait_for(log, r"^serving tiny .* at http://127\.0\.0\.1:\d+/ from 2 processes")
        url = re.search(r"(http://127\.0\.0\.1:\d+)/", line).group(1)
        wait_for(log, r"^ready: 2 server processes, each warmed up batches of 1 to 4 in ")
        wait_ready(lambda path: httpx.get(url + path))
        children = server_processes(proc.pid)
        assert len(children) == 2, children
        expected = httpx.post(url + "/predictions", content=photo()).json()
        assert [p["label"] for p in expected][0] in CLASSES
        # 4 keep-alive clients arriving together: 2 on each process (sharing the listening socket, the
        # process that woke first would take all 4)
        clients = [httpx.Client(base_url=url, timeout=30) for _ in range(4)]
        try:
            for c in clients:
                assert c.post("/predictions", content=photo()).json() == expected
            port = int(url.rsplit(":", 1)[1])
            assert sorted(connections_on(pid, port) for pid in children) == [2, 2]
        finally:
            for c in clients:
                c.close()

        os.kill(children[0], signal.SIGKILL)  # the other answers while the supervisor starts another
        # once the supervisor has seen it go (a connection handed to it as it died would be lost with it)
        wait_for(log, r"^warning: server process \d \(pid \d+\) exited with code -9; starting another")
        for _ in range(10):
            with httpx.Client(base_url=url, timeout=30) as fresh:  # a new connection each time
                assert fresh.post("/predictions", content=photo()).json() == expected
        wait_for(log, r"^ready: server process \d \(restarted\), warmed up batches of 1 to 4 in ")
        replaced = server_processes(proc.pid)
        assert len(replaced) == 2 and children[0] not in replaced and children[1] in replaced

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert server_processes(proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
