"""The lean path for token-authenticated generate requests.

Django's request path (handler, middleware chain, request object) costs
milliseconds per request on a busy host, which a streamed generation pays
before its first token (docs/performance.md). Automation authenticates with an
``Authorization: Token`` header and needs none of that chain (no session, no
CSRF, no messages), so ``InferenceRouter`` answers ``POST
/api/deployments/<id>/generate/`` with such a header itself, through the same
``playground.api.generate_answer`` as the Django view: the same validation,
checks, errors and stream. Everything else, browser sessions included, goes on
to Django unchanged.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from playground.api import _token_may_view, _token_may_view_cached, generate_answer

GENERATE = re.compile(r"^/api/deployments/(\d+)/generate/$")
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


def _token(scope: dict[str, Any]) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization" and value.startswith(b"Token "):
            return value[6:].strip().decode("latin-1")
    return None


class InferenceRouter:
    """ASGI: token-authenticated generate requests here, the rest to ``inner`` (Django)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            match = GENERATE.match(scope["path"])
            token = _token(scope) if match else None
            if token is not None:
                await _generate(int(match[1]), token, receive, send)
                return
        await self.inner(scope, receive, send)


async def _read_body(receive: Any) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _generate(pk: int, token: str, receive: Any, send: Any) -> None:
    raw = await _read_body(receive)
    if raw is None:
        return
    answer = await generate_answer(pk, raw, lambda: _token_may_view(token), lambda: _token_may_view_cached(token))
    if answer.events is None:
        await send({"type": "http.response.start", "status": answer.status, "headers": _JSON})
        await send({"type": "http.response.body", "body": json.dumps(answer.body).encode()})
        return
    await send({"type": "http.response.start", "status": 200, "headers": _SSE})

    async def pump() -> None:
        async for event in answer.events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    streaming, watching = asyncio.create_task(pump()), asyncio.create_task(disconnected())
    await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
    # A client that went away: stopping the stream closes Triton's connection,
    # and Triton cancels the request (the model stops generating).
    for task in (streaming, watching):
        task.cancel()
    await asyncio.gather(streaming, watching, return_exceptions=True)
    await answer.events.aclose()
