"""Websocket authentication: the browser's session cookie, or for automation
an ``Authorization: Token <key>`` header (the same tokens as the REST API)."""

from __future__ import annotations

from typing import Any

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware

from deployments.permissions import user_for_token

_user_for_token = database_sync_to_async(user_for_token)


class TokenAuthMiddleware(BaseMiddleware):
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        headers = dict(scope.get("headers", []))
        auth = headers.get(b"authorization", b"").decode("latin-1")
        if auth.startswith("Token "):
            user = await _user_for_token(auth[len("Token ") :].strip())
            if user is not None:
                scope["user"] = user
        return await super().__call__(scope, receive, send)


def TokenOrSessionAuthMiddlewareStack(inner: Any) -> Any:  # noqa: N802 - mirrors Channels' naming
    return AuthMiddlewareStack(TokenAuthMiddleware(inner))
