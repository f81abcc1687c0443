"""Websocket authentication: the browser's session cookie, or for automation
an ``Authorization: Bearer <token>`` header (the same personal tokens as the REST API)."""

from __future__ import annotations

from typing import Any

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware

from access.services import bearer_secret, token_user

_token_user = database_sync_to_async(token_user)


class TokenAuthMiddleware(BaseMiddleware):
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        headers = dict(scope.get("headers", []))
        secret = bearer_secret(headers.get(b"authorization", b"").decode("latin-1"))
        if secret is not None:
            user = await _token_user(secret)
            if user is not None:
                scope["user"] = user
        return await super().__call__(scope, receive, send)


def TokenOrSessionAuthMiddlewareStack(inner: Any) -> Any:  # noqa: N802 - mirrors Channels' naming
    return AuthMiddlewareStack(TokenAuthMiddleware(inner))
