"""The OpenAI-compatible gateway: ``/v1/...`` answered on the ASGI server
itself (no Django request path), asynchronously end to end.

- GET  /v1/models, /v1/models/<alias>
- POST /v1/chat/completions, /v1/completions   (an llm alias; ``stream`` as server-sent events)
- POST /v1/embeddings                          (an embedding alias; float or base64)
- POST /v1/rerank                              (a reranker alias; query + documents -> results)
- POST /v1/responses                           (an llm alias; OpenAI's Responses API, streamed as typed events)

Every request carries ``Authorization: Bearer <gateway key>``; the key's scope
says which aliases it may name. Errors are OpenAI's shape (gateway.errors).
Each endpoint is a module of gateway.endpoints; its body is a typed request
(gateway.requests).
"""

from __future__ import annotations

from typing import Any

from common import jsonbody, metrics
from common.asgi_io import BodyTooLarge, read_body, send_json
from gateway.access import DATABASE_AWAY
from gateway.endpoints import POST
from gateway.endpoints.models import models
from gateway.endpoints.shared import SEEN, Seen, authenticate
from gateway.errors import GatewayError, database_away

PREFIX = "/v1/"


def owns(scope: dict[str, Any]) -> bool:
    """``/v1/...`` is the gateway's (controlplane.asgi's table)."""
    return scope["path"].startswith(PREFIX) or scope["path"] == "/v1"


async def handle(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if not metrics.enabled():
        await _handle(scope, receive, send)
        return
    seen = Seen()
    SEEN.set(seen)

    async def send_seen(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            seen.code = message["status"]
        await send(message)

    try:
        await _handle(scope, receive, send_seen)
    finally:
        seen.observe()


async def _handle(scope: dict[str, Any], receive: Any, send: Any) -> None:
    path, method = scope["path"], scope["method"]
    try:
        if path.startswith("/v1/models"):
            if method != "GET":
                raise GatewayError(405, f"{method} is not allowed on {path}; use GET", code="method_not_allowed")
            await models(await authenticate(scope["headers"]), path, send)
            return
        handler = POST.get(path)
        if handler is None:
            raise GatewayError(404, f"Unknown endpoint {method} {path}.", code="unknown_url")
        if method != "POST":
            raise GatewayError(405, f"{method} is not allowed on {path}; use POST", code="method_not_allowed")
        caller = await authenticate(scope["headers"])
        raw = await read_body(receive)
        if raw is None:
            return
        try:
            body = jsonbody.loads(raw)
        except jsonbody.InvalidJson as exc:
            raise GatewayError(400, f"the body {exc}", code="invalid_json") from exc
        await handler(caller, body, receive, send)
    except BodyTooLarge as exc:
        await send_json(send, 413, GatewayError(413, str(exc)).body())
    except GatewayError as exc:
        await send_json(send, exc.status, exc.body(), exc.headers())
    except DATABASE_AWAY:
        away = database_away()
        await send_json(send, away.status, away.body(), away.headers())
