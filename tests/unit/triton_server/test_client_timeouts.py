"""A repository load blocks until the model is loaded (minutes for a large engine):
it is bounded by the launch's ready timeout, not by the 60 s of every other call."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from common.errors import TransientError
from triton_server.client import TritonClient

LOAD_S = 1.5  # how long this server's load takes


class _SlowRepository(BaseHTTPRequestHandler):
    """Triton's repository API, answering a load once the (slow) model is in."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        time.sleep(LOAD_S)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> str:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _SlowRepository)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_slow_load_is_waited_for_within_the_load_timeout(server: str) -> None:
    client = TritonClient(server, "secret", network_timeout_s=0.5, load_timeout_s=10)
    try:
        started = time.monotonic()
        client.load("big-engine")
        assert time.monotonic() - started >= LOAD_S
    finally:
        client.close()


def test_a_load_past_its_timeout_is_a_transient_error_naming_the_server(server: str) -> None:
    client = TritonClient(server, "secret", network_timeout_s=10, load_timeout_s=0.5)
    try:
        with pytest.raises(TransientError, match=f"big-engine: server unreachable at {server}"):
            client.load("big-engine")
    finally:
        client.close()
