"""The REST API's token authentication: personal tokens (access.services).

It comes first among the authentication classes, so a request without any
credentials is answered 401 with ``WWW-Authenticate: Bearer``, as HTTP says,
rather than DRF's 403."""

from __future__ import annotations

from typing import Any

from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request

from access.services import TOKEN_PREFIX, bearer_secret, token_user

# The gateway's keys (gateway.services.KEY_PREFIX; access sits below the gateway).
GATEWAY_KEY_PREFIX = "gk-"


class PersonalTokenAuthentication(BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[Any, None] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            return None
        secret = bearer_secret(header)
        if secret is None:
            return None  # another scheme: not ours to judge
        user = token_user(secret)
        if user is None and secret.startswith(GATEWAY_KEY_PREFIX):
            raise AuthenticationFailed(
                f"This is a gateway key ({GATEWAY_KEY_PREFIX}…): it opens /v1 only. /api takes personal API tokens "
                f"({TOKEN_PREFIX}…): make one on the API tokens page (/tokens/) or with `gantry token USERNAME`."
            )
        if user is None:
            raise AuthenticationFailed("the token is unknown, expired or revoked")
        return user, None

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="gantry"'
