"""The lean path for token-authenticated generate requests.

Django's request path (handler, middleware chain, request object) costs
milliseconds per request on a busy host, which a streamed generation pays
before its first token (docs/performance.md). Automation authenticates with an
``Authorization: Bearer`` header and needs none of that chain (no session, no
CSRF, no messages), so ``answer`` takes ``POST
/api/deployments/<id>/generate/`` with such a header itself, through the same
``inference.api.generate_answer`` as the Django view: the same validation,
checks, errors and stream. Everything else, browser sessions included, goes on
to Django unchanged.
"""

from __future__ import annotations

import re
from typing import Any

from access.services import bearer_secret
from access.throttles import throttle_identity
from common.asgi_io import BodyTooLarge, read_body, send_json, stream_events
from common.problems import problem
from inference.api import _token_may_view, _token_may_view_cached, generate_answer

GENERATE = re.compile(r"^/api/deployments/(\d+)/generate/$")


def _token(scope: dict[str, Any]) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            return bearer_secret(value.decode("latin-1"))
    return None


def owns(scope: dict[str, Any]) -> bool:
    """A POST to a deployment's generate action with a bearer token is the lean
    path's (controlplane.asgi's table); without one it is Django's (a session)."""
    return scope["method"] == "POST" and GENERATE.match(scope["path"]) is not None and _token(scope) is not None


async def answer(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await _generate(int(GENERATE.match(scope["path"])[1]), _token(scope), receive, send)


async def _generate(pk: int, token: str, receive: Any, send: Any) -> None:
    try:
        raw = await read_body(receive)
    except BodyTooLarge as exc:
        await send_json(send, 413, problem(413, "too_large", str(exc)))
        return
    if raw is None:
        return
    answer = await generate_answer(
        pk,
        raw,
        lambda: _token_may_view(token),
        throttle_identity(token=token, user_pk=None),
        lambda: _token_may_view_cached(token),
    )
    if answer.events is None:
        headers = [(b"retry-after", str(answer.retry_after).encode())] if answer.retry_after else []
        await send_json(send, answer.status, answer.body, headers=headers)
        return
    await stream_events(send, receive, answer.events)
