"""The lean path answers token-authenticated generate requests itself, with the
same checks and errors as the Django view; everything else goes to Django."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import async_to_sync

from access.services import token_create
from common.asgi_io import Door, Doors
from common.redis_async import forget_clients
from inference import lean

pytestmark = pytest.mark.django_db(transaction=True)


def _router(rest) -> Doors:  # noqa: ANN001
    return Doors((Door("generate", lean.owns, lean.answer),), rest)


def _call(router: Doors, method: str, path: str, headers: list, body: bytes) -> list[dict]:
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    async_to_sync(router)(scope, receive, send)
    return sent


def test_token_requests_for_generate_are_answered_by_the_lean_path(operator):
    reached_django = []

    async def django(scope, receive, send) -> None:  # noqa: ANN001
        reached_django.append(scope["path"])

    router = _router(django)
    key = token_create(user=operator, name="t").secret
    auth = [(b"authorization", f"Bearer {key}".encode())]

    missing = _call(router, "POST", "/api/deployments/999999/generate/", auth, b'{"prompt": "a"}')
    assert missing[0]["status"] == 404
    assert json.loads(missing[1]["body"]) == {
        "status": 404,
        "code": "not_found",
        "detail": "deployment 999999 does not exist",
        "errors": {},
    }

    unknown_field = _call(router, "POST", "/api/deployments/1/generate/", auth, b'{"prompt": "a", "n": 2}')
    assert unknown_field[0]["status"] == 400
    assert json.loads(unknown_field[1]["body"])["errors"] == {"n": ["is not a known field"]}

    bad_key = [(b"authorization", b"Bearer not-a-key")]
    assert _call(router, "POST", "/api/deployments/1/generate/", bad_key, b'{"prompt": "a"}')[0]["status"] == 401

    # No token, another method or another path: Django's.
    _call(router, "POST", "/api/deployments/1/generate/", [], b"{}")
    _call(router, "GET", "/api/deployments/1/generate/", auth, b"")
    _call(router, "POST", "/api/deployments/1/embed/", auth, b"{}")
    assert reached_django == ["/api/deployments/1/generate/"] * 2 + ["/api/deployments/1/embed/"]


def test_generate_requests_are_throttled_per_token_on_the_lean_path_and_per_user_on_djangos(operator, settings, client):  # noqa: ANN001
    settings.GANTRY_API_THROTTLE = "3/minute"
    forget_clients()
    router = _router(lambda *a: None)
    auth = [(b"authorization", f"Bearer {token_create(user=operator, name='t').secret}".encode())]
    codes = [_call(router, "POST", "/api/deployments/999999/generate/", auth, b"{}")[0] for _ in range(4)]
    assert [c["status"] for c in codes] == [404, 404, 404, 429]
    assert 1 <= int(dict(codes[-1]["headers"])[b"retry-after"]) <= 60
    # Another token of the same user has its own count; a browser session its user's.
    other = [(b"authorization", f"Bearer {token_create(user=operator, name='u').secret}".encode())]
    assert _call(router, "POST", "/api/deployments/999999/generate/", other, b"{}")[0]["status"] == 404
    client.force_login(operator)
    answers = [client.post("/api/deployments/999999/generate/", {}, content_type="application/json") for _ in range(4)]
    assert [a.status_code for a in answers] == [404, 404, 404, 429] and int(answers[-1]["Retry-After"]) > 0


def test_a_token_has_one_count_across_the_rest_api_and_the_lean_door(operator, settings):  # noqa: ANN001
    """GANTRY_API_THROTTLE is one budget: calls through DRF and through the lean
    generate door draw on the same counter, so neither doubles a client's rate."""
    from django.core.cache import caches
    from rest_framework.test import APIClient

    caches["shared"].clear()
    settings.GANTRY_API_THROTTLE = "3/minute"
    forget_clients()
    secret = token_create(user=operator, name="one-budget").secret
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert [api.get("/api/hosts/").status_code for _ in range(2)] == [200, 200]
    router = _router(lambda *a: None)
    auth = [(b"authorization", f"Bearer {secret}".encode())]
    codes = [_call(router, "POST", "/api/deployments/999999/generate/", auth, b"{}")[0]["status"] for _ in range(2)]
    assert codes == [404, 429]
    assert api.get("/api/hosts/").status_code == 429
