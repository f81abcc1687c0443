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

import os

from uvicorn_worker import UvicornWorker


class HttpWorker(UvicornWorker):
    """A gunicorn worker running uvicorn for HTTP only: websockets go to live,
    and Django's ASGI handler has no lifespan protocol."""

    CONFIG_KWARGS = {"loop": "uvloop", "http": "httptools", "ws": "none", "lifespan": "off"}


def web_argv(python: str, *, bind: str, port: int, workers: int | None = None) -> list[str]:
    """The web server's command line (GANTRY_WEB_WORKERS processes, default 2 per core up to 8)."""
    count = workers or int(os.environ.get("GANTRY_WEB_WORKERS") or min(8, 2 * (os.cpu_count() or 1)))
    return [
        python, "-m", "gunicorn", "controlplane.asgi:http_application",
        "--worker-class", "controlplane.serving.HttpWorker", "--workers", str(count),
        "--bind", f"{bind}:{port}", "--access-logfile", "-",
        # A streamed generation may be silent for long: uvicorn workers heartbeat
        # on their own, so this only catches a worker that is truly stuck.
        "--timeout", "120", "--graceful-timeout", "30",
    ]  # fmt: skip


def live_argv(python: str, *, bind: str, port: int) -> list[str]:
    """The live (websocket) server's command line."""
    return [python, "-m", "daphne", "-b", bind, "-p", str(port), "controlplane.asgi:websocket_application"]
