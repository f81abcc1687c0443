"""ASGI entry points (controlplane.serving says which server runs which):

- ``http_application``: Django, with the doors of ``HTTP_DOORS`` in front of
  it, which skip Django's request path: /metrics with the scrape token
  (controlplane.metrics), the OpenAI-compatible gateway (/v1/...,
  gateway.app) and token-authenticated generate requests (inference.lean).
  Django itself answers by ``DjangoDoors``: sync views in WSGI mode on a
  thread pool, async views (the streamed generate action) by its ASGI handler;
- ``websocket_application``: the Channels consumers (the live server), and
  /metrics;
- ``application``: both in one process, for a single-process setup.
"""

import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# The servers borrow PostgreSQL connections from a pool (see settings). A web
# process runs its sync requests on as many threads: with 8, they queued on
# the GIL each time one came back from PostgreSQL, and a process served 10-15%
# fewer list pages at a higher p99 than with 4 (docs/performance.md).
SERVER_POOL_SIZE = 4
os.environ.setdefault("DATABASE_POOL_SIZE", str(SERVER_POOL_SIZE))
django_asgi_app = get_asgi_application()

from a2wsgi import WSGIMiddleware  # noqa: E402
from asgiref.sync import iscoroutinefunction  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.wsgi import get_wsgi_application  # noqa: E402
from django.urls import Resolver404, resolve  # noqa: E402

from access.ws_auth import TokenOrSessionAuthMiddlewareStack  # noqa: E402
from common.asgi_io import Door, Doors, send_bytes  # noqa: E402
from controlplane import metrics  # noqa: E402
from deployments.routing import websocket_urlpatterns  # noqa: E402
from gateway import app as gateway  # noqa: E402
from inference import lean  # noqa: E402


class DjangoDoors:
    """Each Django request by the cheaper door that serves it.

    Django's ASGI handler runs a sync view, and every hook of every sync
    middleware, each in its own hop to a thread made for the request: a dozen
    hops, which made a plain page about 3x slower than the same view in WSGI mode
    (docs/performance.md). So a request for a sync view (all but the streamed
    generate action) runs in WSGI mode on this process's thread pool, one hop in
    all, with as many threads as the process has pooled database connections. A
    request for an async view goes to the ASGI handler, which streams it without
    holding a thread."""

    def __init__(self) -> None:
        self.sync = WSGIMiddleware(get_wsgi_application(), workers=settings.DATABASE_POOL_SIZE or SERVER_POOL_SIZE)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        door = django_asgi_app if _async_view(scope) else self.sync
        await door(scope, receive, send)


def _async_view(scope: dict[str, Any]) -> bool:
    path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
    try:
        return iscoroutinefunction(resolve(path).func)
    except Resolver404:
        return False


async def _not_found(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send_bytes(send, 404, b"the live server answers websockets and /metrics only\n", "text/plain")


METRICS = Door("GET /metrics", metrics.owns, metrics.MetricsDoor(metrics.ControlPlane()))
# Every HTTP path the web server answers before Django, in the order they are tried.
HTTP_DOORS = (
    METRICS,
    Door("/v1/... (the OpenAI-compatible gateway)", gateway.owns, gateway.handle),
    Door("POST /api/deployments/<id>/generate/ with a bearer token", lean.owns, lean.answer),
)
http_application = Doors(HTTP_DOORS, DjangoDoors())
_websockets = AllowedHostsOriginValidator(TokenOrSessionAuthMiddlewareStack(URLRouter(websocket_urlpatterns)))
# The live server's own /metrics (its websocket figures) and nothing else over HTTP.
websocket_application = ProtocolTypeRouter(
    {"websocket": _websockets, "http": Doors((Door(METRICS.paths, metrics.owns, metrics.MetricsDoor()),), _not_found)}
)
application = ProtocolTypeRouter({"http": http_application, "websocket": _websockets})
