"""The lean path for token-authenticated generate requests.

Django's request path (handler, middleware chain, request object) costs
milliseconds per request on a busy host, which a streamed generation pays
before its first token (docs/performance.md). Automation authenticates with an
``Authorization: Bearer`` header and needs none of that chain (no session, no
CSRF, no messages), so ``InferenceRouter`` answers ``POST
/api/deployments/<id>/generate/`` with such a header itself, through the same
``playground.api.generate_answer`` as the Django view: the same validation,
checks, errors and stream. Everything else, browser sessions included, goes on
to Django unchanged.
"""

from __future__ import annotations

import re
from typing import Any

from access.services import bearer_secret
from common.asgi_io import BodyTooLarge, read_body, send_json, stream_events
from common.problems import problem
from playground.api import _token_may_view, _token_may_view_cached, generate_answer, token_identity

GENERATE = re.compile(r"^/api/deployments/(\d+)/generate/$")


def _token(scope: dict[str, Any]) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            return bearer_secret(value.decode("latin-1"))
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


async def _generate(pk: int, token: str, receive: Any, send: Any) -> None:
    try:
        raw = await read_body(receive)
    except BodyTooLarge as exc:
        await send_json(send, 413, problem(413, "too_large", str(exc)))
        return
    if raw is None:
        return
    answer = await generate_answer(
        pk, raw, lambda: _token_may_view(token), token_identity(token), lambda: _token_may_view_cached(token)
    )
    if answer.events is None:
        headers = [(b"retry-after", str(answer.retry_after).encode())] if answer.retry_after else []
        await send_json(send, answer.status, answer.body, headers=headers)
        return
    await stream_events(send, receive, answer.events)
