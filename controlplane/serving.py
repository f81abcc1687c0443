"""How Gantry's two servers run, in one place (the demo, the tests, the
benchmarks and docker-compose.yml all start them from here).

- web: pages, REST API, admin, the generate action and the OpenAI gateway,
  on gunicorn with several uvicorn worker processes. A slow request (a
  10 000-row page, a long generation) holds one worker's loop or thread, not
  the whole server.
- live: the websockets (Channels) on their own daphne process, so a busy web
  tier cannot delay the live updates.

Behind one address, a proxy routes /ws/ to live; without one, the browser
reaches live on GANTRY_LIVE_PORT of the same host.
"""

from __future__ import annotations

import gc
import os

from uvicorn_worker import UvicornWorker

# Collect the youngest objects every 50 000 allocations instead of 700, and
# the older generations as rarely as before relative to it.
GC_THRESHOLDS = (50_000, 20, 100)


class HttpWorker(UvicornWorker):
    """A gunicorn worker running uvicorn for HTTP only: websockets go to live,
    and Django's ASGI handler has no lifespan protocol."""

    CONFIG_KWARGS = {"loop": "uvloop", "http": "httptools", "ws": "none", "lifespan": "off"}

    def load_wsgi(self) -> None:
        super().load_wsgi()
        settle_heap()


def settle_heap() -> None:
    """Keep the garbage collector off what the process loaded once (Django, its
    URL resolver and models: most of the heap), and run it less often.

    A 50-row page allocates tens of thousands of short-lived objects; with
    Python's default thresholds that set off collections that walked the whole
    heap in the middle of requests, and the pages' p99 latency was 2-3x what it
    is with this (docs/performance.md). Cycles are still collected.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def web_workers() -> int:
    """GANTRY_WEB_WORKERS, else two web processes per core, at most 8.

    One per core measured a lower p99 when the clients' connections were spread
    evenly, but a process takes every connection that arrives while it is
    awake: at times all of them landed on one of two processes, and the pages
    served half as much (docs/performance.md)."""
    return int(os.environ.get("GANTRY_WEB_WORKERS") or min(8, 2 * (os.cpu_count() or 1)))


def web_argv(python: str, *, bind: str, port: int, workers: int | None = None) -> list[str]:
    """The web server's command line (``workers`` processes, else web_workers())."""
    return [
        python, "-m", "gunicorn", "controlplane.asgi:http_application",
        "--worker-class", "controlplane.serving.HttpWorker", "--workers", str(workers or web_workers()),
        "--bind", f"{bind}:{port}", "--access-logfile", "-",
        # A streamed generation may be silent for long: uvicorn workers heartbeat
        # on their own, so this only catches a worker that is truly stuck.
        "--timeout", "120", "--graceful-timeout", "30",
    ]  # fmt: skip


def live_argv(python: str, *, bind: str, port: int) -> list[str]:
    """The live (websocket) server's command line."""
    return [python, "-m", "daphne", "-b", bind, "-p", str(port), "controlplane.asgi:websocket_application"]
