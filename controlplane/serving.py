"""How Gantry's servers run, in one place (the demo, the tests, the benchmarks
and docker-compose.yml all start them from here). Each door is on the kind of
server that fits it:

- pages: the pages, the REST API and the admin, plain sync Django on gunicorn's
  sync workers, each with its own kept database connection. A request runs on
  the process that read it: no hop to an event loop and back.
- web: the doors that stream or wait on Triton (the OpenAI gateway under /v1/,
  the generate action, /metrics) on gunicorn with uvicorn worker processes. It
  answers every other path too (pages in WSGI mode on a thread pool), so one
  web server alone is a whole control plane: the demo runs it that way, with
  the websockets on the same port.
- live: the websockets (Channels) on their own daphne process, so a busy web
  tier cannot delay the live updates.

Behind one address, a proxy routes each path to its server (``gantry
proxy-config`` writes nginx's configuration for it: controlplane.proxy).
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import queue
import socket
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from gunicorn import glogging
from uvicorn_worker import UvicornWorker

from common import metrics_folder

# Collect the youngest objects every 50 000 allocations instead of 700, and
# the older generations as rarely as before relative to it.
GC_THRESHOLDS = (50_000, 20, 100)
# How long another thread may hold the interpreter before the event loop gets it
# back (seconds; Python's default is 0.005).
SWITCH_INTERVAL_S = 0.001


class HttpWorker(UvicornWorker):
    """A gunicorn worker running uvicorn for HTTP only: websockets go to live,
    and Django's ASGI handler has no lifespan protocol. Its access lines are
    AccessLog's, not uvicorn's."""

    CONFIG_KWARGS = {"loop": "uvloop", "http": "httptools", "ws": "none", "lifespan": "off", "access_log": False}

    def load_wsgi(self) -> None:  # in the worker process, after the fork
        super().load_wsgi()
        # gunicorn's own access logger: with access_log off, uvicorn empties "uvicorn.access".
        self.wsgi = AccessLog(self.wsgi, self.log.access_log)


class DemoWorker(HttpWorker):
    """The web worker with websockets on: the demo serves every door on one port."""

    CONFIG_KWARGS = {**HttpWorker.CONFIG_KWARGS, "ws": "websockets"}


def settle_heap(*, event_loop: bool = True) -> None:
    """Keep the garbage collector off what the process loaded once (Django, its
    URL resolver and models: most of the heap); in an ``event_loop`` process,
    run it less often too.

    A 50-row page allocates tens of thousands of short-lived objects; with
    Python's default thresholds that set off collections that walked the whole
    heap in the middle of requests, and the pages' p99 latency was 2-3x what it
    is with this (docs/performance.md). Cycles are still collected.

    A sync worker (the pages server) keeps the default thresholds: it serves one
    request at a time, and a young generation of 50 000 objects only made each
    collection longer, inside whichever request set it off (events list p99
    57-72 ms against 39-43 ms, docs/performance.md).
    """
    gc.collect()
    gc.freeze()
    if not event_loop:
        return
    gc.set_threshold(*GC_THRESHOLDS)
    # The gateway's helper threads (its caches' database reads, the usage counts'
    # write, the log writer below) run Python for a millisecond or more at a time;
    # with the default interval each could keep a request's answer waiting up to 5 ms.
    sys.setswitchinterval(SWITCH_INTERVAL_S)


# One access line per request on every server: client, request line, status,
# body bytes sent, seconds.
ACCESS_LINE = '%s - "%s %s HTTP/%s" %d %d %.3f'


class AccessLog:
    """ASGI: one access line per HTTP request once it has ended (client, method,
    path, status, body bytes sent, seconds), written by a thread of its own to
    ``logger``'s handlers (gunicorn's --access-logfile).

    uvicorn writes its line when the response starts, formatted on the event
    loop: for a streamed generation that is in front of the first token
    (0.1-0.3 ms, docs/performance.md). Here the loop only queues a tuple when
    the request is over; a write that waits (a disk flushing, a pipe's slow
    reader) holds no answer either."""

    def __init__(self, app: Any, logger: logging.Logger) -> None:
        self.app, self.logger = app, logger
        self.ended: queue.SimpleQueue = queue.SimpleQueue()
        self.on = logger.isEnabledFor(logging.INFO)
        if self.on:
            threading.Thread(target=self._write, name="gantry-access-log", daemon=True).start()
            atexit.register(self._drain)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.on:
            await self.app(scope, receive, send)
            return
        started, status, sent = time.perf_counter(), 0, 0

        async def counted(message: dict[str, Any]) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            self.ended.put((scope, status, sent, time.perf_counter() - started))

    def _write(self) -> None:
        while True:
            self._line(*self.ended.get())

    def _drain(self) -> None:  # at exit: what the thread has not written yet
        while True:
            try:
                self._line(*self.ended.get_nowait())
            except queue.Empty:
                return

    def _line(self, scope: dict[str, Any], status: int, sent: int, seconds: float) -> None:
        client = scope.get("client")
        path = urllib.parse.quote(scope["path"])
        if scope["query_string"]:
            path = f"{path}?{scope['query_string'].decode('ascii', 'replace')}"
        self.logger.info(
            ACCESS_LINE,
            f"{client[0]}:{client[1]}" if client else "-", scope["method"], path, scope["http_version"],
            status or 500, sent, seconds,
        )  # fmt: skip


class SyncAccessLog(glogging.Logger):
    """gunicorn's logger for the pages server, with the web server's access line
    (ACCESS_LINE). gunicorn's own line gathers every request header and environ
    entry into a dict first, for any format one might ask: on a 50-row page that
    cost 9 % of the sync worker's requests per second (docs/performance.md)."""

    def access(self, resp: Any, req: Any, environ: dict[str, Any], request_time: Any) -> None:
        if not self.access_log_enabled:
            return
        address, version = environ.get("REMOTE_ADDR"), "{}.{}".format(*req.version)
        self.access_log.info(
            ACCESS_LINE, f"{address}:{environ.get('REMOTE_PORT')}" if address else "-", environ["REQUEST_METHOD"],
            environ["RAW_URI"], version, resp.status_code or 500, resp.sent, request_time.total_seconds(),
        )  # fmt: skip


def web_workers() -> int:
    """GANTRY_WEB_WORKERS, else one web process per core, 2 to 8.

    Each process serves its sync requests on a thread pool, so a slow request
    holds a thread, not the process; twice as many processes as cores only
    time-sliced the same cores, for a p99 twice as high (docs/performance.md)."""
    return int(os.environ.get("GANTRY_WEB_WORKERS") or min(8, max(2, os.cpu_count() or 1)))


KEEP_ALIVE_S = 75


def web_argv(python: str, *, bind: str, port: int, workers: int | None = None, websockets: bool = False) -> list[str]:
    """The web (ASGI) server's command line (``workers`` processes, else
    web_workers()); with ``websockets``, the Channels consumers on the same
    port (the demo's one address)."""
    if websockets:
        app, worker_class = "controlplane.asgi:application", "controlplane.serving.DemoWorker"
    else:
        app, worker_class = "controlplane.asgi:http_application", "controlplane.serving.HttpWorker"
    return _gunicorn(python, app, worker_class, bind, port, workers)


def pages_argv(python: str, *, bind: str, port: int, workers: int | None = None) -> list[str]:
    """The pages (WSGI) server's command line: ``workers`` sync processes (else
    web_workers()), one request at a time each, on one shared socket.

    A sync process accepts a connection only when it is free, so the shared
    socket hands each request to an idle process. With a socket per process
    (--reuse-port) or gthread's kept connections, the kernel's spread left one
    process with more clients than the other, and the pages' p99 was 1.8-2.2x
    the plain sync floor's against 1.4-1.5x (docs/performance.md)."""
    return [
        *_gunicorn(python, "controlplane.wsgi:application", "sync", bind, port, workers, reuse_port=False),
        "--logger-class",
        "controlplane.serving.SyncAccessLog",
    ]


def _gunicorn(
    python: str, app: str, worker_class: str, bind: str, port: int, workers: int | None, *, reuse_port: bool = True
) -> list[str]:
    """gunicorn's command line for ``app`` on ``bind``:``port``.

    With ``reuse_port`` (the web server), each process listens on a socket of
    its own (``--reuse-port``), and the kernel spreads new connections over
    them. On one shared socket, the event-loop process that woke first took
    every connection waiting: at times all of a client's keep-alive connections
    landed on one of two processes, which then served half as much. (The pages
    server's sync processes take one at a time, so they share one: pages_argv.)
    SO_REUSEPORT also lets another server of the same user bind the port:
    port_taken() says whether one is there before a command starts.
    """
    return [
        python, "-m", "gunicorn", app,
        "--worker-class", worker_class, "--workers", str(workers or web_workers()),
        "--bind", f"{bind}:{port}", *(["--reuse-port"] if reuse_port else []), "--access-logfile", "-",
        # A streamed generation may be silent for long: uvicorn workers heartbeat
        # on their own, so this only catches a worker that is truly stuck.
        "--timeout", "120", "--graceful-timeout", "30",
        # An idle keep-alive connection stays open longer than clients keep theirs
        # (aiohttp 15 s, httpx 5 s): at gunicorn's 2 s, a client reusing one as the
        # server closed it lost that request ("Cannot write to closing transport").
        "--keep-alive", str(KEEP_ALIVE_S),
        # on_starting, post_worker_init and child_exit below: the processes' shared
        # metrics folder, their heap.
        "--config", "python:controlplane.serving",
        "--control-socket", str(control_socket_path(bind, port)),
    ]  # fmt: skip


def control_socket_path(bind: str, port: int) -> Path:
    """gunicorn's control socket for the server on ``bind``:``port``: its own, in
    a folder only this user may enter. gunicorn's default is one path per user
    (~/.gunicorn/gunicorn.ctl), so a command meant for one server reached
    whichever of them had started last. (Not named control_socket: gunicorn
    reads this module's names as its settings.)"""
    folder = Path(tempfile.gettempdir()) / f"gantry-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.stat().st_uid != os.getuid() or folder.stat().st_mode & 0o077:
        raise RuntimeError(f"{folder} is not this user's alone: remove it")
    return folder / f"web-{bind.strip('[]').replace(':', '_')}-{port}.ctl"


def on_starting(server: object) -> None:
    """gunicorn's master, before its workers start: their metrics folder."""
    metrics_folder.prepare("gantry-web-metrics-")


def post_worker_init(worker: object) -> None:
    """A gunicorn worker process, once it has loaded its application."""
    settle_heap(event_loop=isinstance(worker, UvicornWorker))


def when_ready(server: Any) -> None:
    """gunicorn's own "Listening at:" line is empty where every worker binds its
    own socket (--reuse-port): say where the server listens."""
    server.log.info("gantry web: listening on %s", ", ".join(f"http://{bind}/" for bind in server.cfg.bind))


def on_exit(server: object) -> None:
    metrics_folder.remove_made()


def child_exit(server: object, worker: object) -> None:
    from common import metrics

    metrics.process_exited(worker.pid)  # type: ignore[attr-defined]


def port_taken(bind: str, port: int) -> bool:
    """Whether something listens on ``bind``:``port`` already (a plain bind
    fails there, even where a server shares it by SO_REUSEPORT)."""
    family, kind, proto, _, address = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # closed connections do not count
        try:
            probe.bind(address)
        except OSError:
            return True
    return False


def live_argv(python: str, *, bind: str, port: int) -> list[str]:
    """The live (websocket) server's command line."""
    return [python, "-m", "daphne", "-b", bind, "-p", str(port), "controlplane.asgi:websocket_application"]
