"""The web server's process settings (controlplane.serving)."""

from __future__ import annotations

import gc
import logging
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


def test_access_lines_are_written_by_a_thread_not_the_event_loop(tmp_path):
    """A write that waits (a full pipe, a disk flushing) must not hold the loop: the
    loop's thread only queues the record; the file's handler runs on another thread."""
    logger = logging.getLogger("gantry-test-access")
    writers: list[str] = []

    class File(logging.FileHandler):
        def emit(self, record: logging.LogRecord) -> None:
            writers.append(threading.current_thread().name)
            super().emit(record)

    handler = File(tmp_path / "access.log")
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    serving.log_off_the_loop("gantry-test-access")
    try:
        logger.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", "/healthz", "1.1", 200)
        for _ in range(100):
            if writers:
                break
            threading.Event().wait(0.02)
    finally:
        logger.handlers = []
        handler.close()
    assert writers and writers[0] != threading.current_thread().name
    assert (tmp_path / "access.log").read_text() == '127.0.0.1:5 - "GET /healthz HTTP/1.1" 200\n'


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
