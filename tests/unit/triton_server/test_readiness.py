"""Readiness says why: a refused connection, or each model's state and Triton's
reason from the repository index, rather than a bare "not ready"."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from triton_server.client import ADMIN_HEADER, TritonClient


class _HalfReady(BaseHTTPRequestHandler):
    """Triton's health and repository APIs: live, "llm" ready, "embedder" failed to load."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        ok = self.path in ("/v2/health/live", "/v2/health/ready", "/v2/models/llm/ready")
        self._answer(200 if ok else 400, b"")

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path != "/v2/repository/index" or self.headers.get(ADMIN_HEADER) != "secret":
            self._answer(403, b'{"error":"This API is restricted"}')
            return
        index = [{"name": "llm", "version": "1", "state": "READY"},
                 {"name": "embedder", "version": "1", "state": "UNAVAILABLE",
                  "reason": "failed to load 'embedder': out of memory"}]  # fmt: skip
        self._answer(200, json.dumps(index).encode())

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_model_not_ready_carries_tritons_reason_and_a_dead_port_says_refused():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _HalfReady)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"127.0.0.1:{httpd.server_address[1]}"
    try:
        state = TritonClient(url, "secret").readiness(["llm", "embedder"])
        assert state.models == {"llm": True, "embedder": False}
        assert state.cause == "embedder is unavailable: failed to load 'embedder': out of memory"
        # Without the admin secret the index is refused: the cause still names the model.
        assert TritonClient(url).readiness(["embedder"]).cause == "embedder is not ready"
        assert TritonClient(url, "secret").readiness(["llm"]).cause == ""
    finally:
        httpd.shutdown()
        httpd.server_close()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    gone = TritonClient(f"127.0.0.1:{closed}").readiness(["llm"])
    assert not gone.live and "connection refused" in gone.cause and str(closed) in gone.cause
