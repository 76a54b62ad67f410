import functools
import http.server
import os
import tempfile
import threading

import pytest
import torch


def pytest_configure(config):
    """The autotuning cache (vitkit.cpu.autotune) of the test session in a folder of its own, inherited by the
    processes the tests start: choices are timed afresh once per session, and a user's cache is left alone."""
    if "VITKIT_CACHE_DIR" not in os.environ:
        os.environ["VITKIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="vitkit-test-cache-")


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same random state."""
    torch.manual_seed(0)
    yield


@pytest.fixture
def threads():
    """Run a test with n intra-op threads; the setting is restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # keep pytest's output clean
        pass


@pytest.fixture
def http_server(tmp_path):
    """A real HTTP server on 127.0.0.1 (loopback only) serving tmp_path/served; yields (folder, base URL)."""
    served = tmp_path / "served"
    served.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield served, f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
