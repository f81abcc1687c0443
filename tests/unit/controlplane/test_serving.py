"""The web server's process settings (controlplane.serving)."""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import socket
import sys
import threading

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from controlplane import serving


def test_a_web_process_keeps_the_collector_off_what_it_loaded():
    thresholds, interval = gc.get_threshold(), sys.getswitchinterval()
    try:
        serving.settle_heap()
        assert gc.get_freeze_count() > 10_000  # Django and Gantry, as imported by this test run
        assert gc.get_threshold() == serving.GC_THRESHOLDS
        assert gc.isenabled()  # cycles made by requests are still collected
        assert sys.getswitchinterval() == pytest.approx(serving.SWITCH_INTERVAL_S)
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        sys.setswitchinterval(interval)


def test_a_sync_worker_freezes_what_it_loaded_and_keeps_the_default_collector():
    """The pages server's processes serve one request at a time: a larger young
    generation would only make each collection longer, inside a request."""
    thresholds, interval = gc.get_threshold(), sys.getswitchinterval()
    try:
        serving.settle_heap(event_loop=False)
        assert gc.get_freeze_count() > 10_000
        assert gc.get_threshold() == thresholds and sys.getswitchinterval() == interval
    finally:
        gc.unfreeze()


def test_the_pages_servers_access_line_is_the_web_servers(tmp_path):
    from datetime import timedelta
    from types import SimpleNamespace

    from gunicorn.config import Config

    config = Config()
    config.set("accesslog", str(tmp_path / "access.log"))
    log = serving.SyncAccessLog(config)
    environ = {"REMOTE_ADDR": "127.0.0.1", "REMOTE_PORT": "5", "REQUEST_METHOD": "GET",
               "RAW_URI": "/api/builds/?limit=50", "HTTP_AUTHORIZATION": "Bearer secret"}  # fmt: skip
    response = SimpleNamespace(status_code=200, sent=23, headers=[])
    log.access(response, SimpleNamespace(version=(1, 1)), environ, timedelta(milliseconds=12))
    for handler in log.access_log.handlers:
        handler.flush()
    line = (tmp_path / "access.log").read_text()
    assert line == '127.0.0.1:5 - "GET /api/builds/?limit=50 HTTP/1.1" 200 23 0.012\n'
    argv = serving.pages_argv("python", bind="127.0.0.1", port=1)
    assert argv[argv.index("--logger-class") + 1] == "controlplane.serving.SyncAccessLog"


def test_an_access_line_is_written_by_a_thread_once_the_request_has_ended(tmp_path):
    """The loop only queues what the request did, when it is over (a streamed answer's
    first token waits on no log line); the file's handler runs on another thread."""
    logger = logging.getLogger("gantry-test-access")
    writers: list[str] = []

    class File(logging.FileHandler):
        def emit(self, record: logging.LogRecord) -> None:
            writers.append(threading.current_thread().name)
            super().emit(record)

    handler = File(tmp_path / "access.log")
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    written_before_the_end: list[str] = []

    async def app(scope, receive, send) -> None:  # noqa: ANN001
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await asyncio.sleep(0.1)
        written_before_the_end.append((tmp_path / "access.log").read_text())
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def send(message: dict) -> None:
        pass

    scope = {"type": "http", "client": ("127.0.0.1", 5), "method": "POST", "path": "/v1/completions",
             "query_string": b"a=1", "http_version": "1.1"}  # fmt: skip
    try:
        asyncio.run(serving.AccessLog(app, logger)(scope, None, send))
        for _ in range(100):
            if writers:
                break
            threading.Event().wait(0.02)
    finally:
        logger.handlers = []
        handler.close()
    assert written_before_the_end == [""]
    assert writers and writers[0] != threading.current_thread().name
    line = (tmp_path / "access.log").read_text()
    assert re.fullmatch(r'127\.0\.0\.1:5 - "POST /v1/completions\?a=1 HTTP/1\.1" 200 23 0\.1\d\d\n', line), line


def test_one_web_process_per_core_unless_told(monkeypatch):
    monkeypatch.delenv("GANTRY_WEB_WORKERS", raising=False)
    for cores, processes in ((1, 2), (2, 2), (6, 6), (64, 8)):
        monkeypatch.setattr(serving.os, "cpu_count", lambda cores=cores: cores)
        assert serving.web_workers() == processes
    monkeypatch.setenv("GANTRY_WEB_WORKERS", "3")
    assert serving.web_workers() == 3
    argv = serving.web_argv("python", bind="127.0.0.1", port=8000)
    assert argv[argv.index("--workers") + 1] == "3"
    assert "controlplane.serving.HttpWorker" in argv
    assert "--reuse-port" in argv  # a socket per process, connections spread by the kernel
    assert argv[argv.index("--keep-alive") + 1] == "75"  # longer than clients keep an idle connection


def _listener(reuse_port: bool) -> socket.socket:
    listener = socket.socket()
    if reuse_port:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener


def test_a_port_a_server_listens_on_is_taken_even_when_it_shares_it():
    for reuse_port in (False, True):
        listener = _listener(reuse_port)
        port = listener.getsockname()[1]
        assert serving.port_taken("127.0.0.1", port)
        listener.close()
        assert not serving.port_taken("127.0.0.1", port)


def test_gantry_serve_refuses_a_port_in_use(monkeypatch):
    def started(*argv: object) -> None:
        raise AssertionError(f"gantry_serve started a server on a port in use: {argv}")

    # Were the check to let it through, the command would replace this test run with the server.
    monkeypatch.setattr("controlplane.management.commands.gantry_serve.os.execv", started)
    listener = _listener(reuse_port=True)
    try:
        with pytest.raises(CommandError, match=r"--port: 127.0.0.1:\d+ is in use already"):
            call_command("gantry_serve", "web", "--port", str(listener.getsockname()[1]))
    finally:
        listener.close()
