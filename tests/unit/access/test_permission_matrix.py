"""One role model on every door: each API operation in the OpenAPI schema
(and the generate action beside it), each page, and each websocket group,
tried as anonymous, viewer, operator and admin. A new endpoint is in this
matrix the moment it is in the schema."""

from __future__ import annotations

import re
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import Group, User
from drf_spectacular.generators import SchemaGenerator
from rest_framework.test import APIClient

from access.services import token_create
from access.ws_auth import TokenOrSessionAuthMiddlewareStack
from core.permissions import ADMIN_GROUP
from deployments.models import ModelDownload
from deployments.routing import websocket_urlpatterns
from deployments.services import builds
from gateway import services as gateway
from gateway.models import Alias
from loadtests.models import LoadTest, TuningRun
from tests import factories

ROLES = ("anonymous", "viewer", "operator", "admin")
# Writes a viewer may make: their own tokens, and queries to deployed models.
VIEWER_WRITES = {
    ("POST", "/api/tokens/"),
    ("POST", "/api/tokens/{id}/revoke/"),
    ("POST", "/api/deployments/{id}/embed/"),
    ("POST", "/api/deployments/{id}/rerank/"),
    ("POST", "/api/deployments/{id}/generate/"),
}
# Joining and revoking GPU hosts hands out database access, and cordoning or draining
# one moves every deployment on it: admins only.
ADMIN_ONLY = {
    ("POST", "/api/hosts/join-tokens/"),
    ("POST", "/api/hosts/{name}/revoke/"),
    ("POST", "/api/hosts/{name}/cordon/"),
    ("POST", "/api/hosts/{name}/uncordon/"),
    ("POST", "/api/hosts/{name}/drain/"),
}
# A host joining has no account: its one-time join token, in the body, is the credential.
BODY_TOKEN = {("POST", "/api/hosts/join/")}
# Beside the schema: the generate action streams, so it is a plain async view.
EXTRA_OPERATIONS = [("POST", "/api/deployments/{id}/generate/")]


def _operations() -> list[tuple[str, str]]:
    schema = SchemaGenerator().get_schema(request=None, public=True)
    found = [
        (method.upper(), path)
        for path, item in schema["paths"].items()
        for method in item
        if method in ("get", "post", "put", "patch", "delete")
    ]
    return sorted(found + EXTRA_OPERATIONS)


@pytest.fixture
def world(llama, minilm, host, operator) -> dict[str, Any]:  # noqa: ANN001
    deployment = factories.deployment(host=host, user=operator)
    build, _ = builds.build_request(model="llama", host="h100-host", image=factories.IMAGE, spec={}, user=operator)
    alias = Alias.objects.create(name="chat", deployment=deployment, triton_name="minilm")
    key = gateway.key_create(name="k", user=operator, all_aliases=True).key
    users = {
        "viewer": User.objects.create_user("matrix-viewer"),
        "operator": operator,
        "admin": User.objects.create_user("matrix-admin"),
    }
    users["admin"].groups.add(Group.objects.get_or_create(name=ADMIN_GROUP)[0])
    token = token_create(user=users["viewer"], name="t").token
    run = LoadTest.objects.create(deployment=deployment, deployment_name=deployment.name, alias="chat",
                                  triton_name="minilm", kind="embedding", workload={}, status="succeeded")  # fmt: skip
    tuned = TuningRun.objects.create(deployment=deployment, deployment_name=deployment.name, start_generation=1,
                                     spec={"mix": [], "space": {}}, status="succeeded")  # fmt: skip
    download = ModelDownload.objects.create(model=minilm, host=host)
    ids = {
        "deployments": deployment.pk, "builds": build.pk, "models": minilm.pk, "aliases": alias.pk,
        "downloads": download.pk, "copies": host.name, "keys": key.pk, "tokens": token.pk, "hosts": host.name,
        "loadtests": run.pk, "tuning": tuned.pk,
    }  # fmt: skip
    return {"users": users, "ids": ids}


def _concrete(path: str, ids: dict[str, Any]) -> str:
    def fill(match: re.Match) -> str:
        collection = path[: match.start()].rstrip("/").rsplit("/", 1)[-1]
        return str(ids[collection])

    return re.sub(r"\{(id|name|pk)\}", fill, path)


def _client(role: str, world: dict[str, Any]) -> APIClient:
    """A client with the role's real credentials (a personal token), as automation calls."""
    client = APIClient()
    if role != "anonymous":
        secret = token_create(user=world["users"][role], name="matrix").secret
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


@pytest.mark.parametrize("role", ROLES)
def test_every_api_operation_answers_each_role_by_the_same_rule(role, world):  # noqa: ANN001
    client = _client(role, world)
    wrong = []
    for method, path in _operations():
        url = _concrete(path, world["ids"])
        response = getattr(client, method.lower())(url, {} if method != "GET" else None, format="json")
        code = response.status_code
        if (method, path) in BODY_TOKEN:
            expected_ok = code == 400 and "token" in response.json()["errors"]  # no token, whoever asks
        elif role == "anonymous":
            expected_ok = code == 401
        elif (method, path) in ADMIN_ONLY and role != "admin":
            expected_ok = code == 403
        elif role == "viewer" and method != "GET" and (method, path) not in VIEWER_WRITES:
            expected_ok = code == 403
        else:
            expected_ok = code not in (401, 403)
        if not expected_ok:
            wrong.append(f"{method} {url}: {code}")
    assert not wrong, wrong


PAGES = ["/", "/models/{models}/", "/builds/{builds}/", "/deployments/{deployments}/", "/gateway/", "/tokens/",
         "/api/docs/", "/loadtests/", "/loadtests/{loadtests}/", "/tuning/",
         "/tuning/{tuning}/"]  # fmt: skip


@pytest.mark.parametrize("role", ROLES)
def test_every_page_answers_each_role_by_the_same_rule(role, world, client):  # noqa: ANN001
    if role != "anonymous":
        client.force_login(world["users"][role])
    for page in PAGES:
        response = client.get(page.format(**world["ids"]))
        if role == "anonymous":
            assert response.status_code == 302 and response["Location"].startswith("/login/"), page
        else:
            assert response.status_code == 200, page
    admin = client.get("/admin/")
    if role == "admin":
        assert admin.status_code == 200
    else:
        assert admin.status_code == 302 and "login" in admin["Location"]


@pytest.mark.parametrize("role", ROLES)
def test_a_page_form_refuses_a_viewer_as_the_api_does(role, world, client):  # noqa: ANN001
    if role == "anonymous":
        return
    client.force_login(world["users"][role])
    before = Alias.objects.count()
    body = {"action": "alias", "name": f"by-{role}", "target": f"{world['ids']['deployments']}/minilm"}
    client.post("/gateway/", body)
    assert Alias.objects.count() == before + (0 if role == "viewer" else 1)


@pytest.mark.django_db(transaction=True)  # the consumer reads on its own connection
@pytest.mark.parametrize("role", ROLES)
def test_every_websocket_group_answers_each_role_by_the_same_rule(role, world):  # noqa: ANN001
    headers = []
    if role != "anonymous":
        secret = token_create(user=world["users"][role], name="ws").secret
        headers = [(b"authorization", f"Bearer {secret}".encode())]
    app = TokenOrSessionAuthMiddlewareStack(URLRouter(websocket_urlpatterns))
    for path in (
        "/ws/dashboard/",
        f"/ws/deployments/{world['ids']['deployments']}/",
        f"/ws/builds/{world['ids']['builds']}/",
    ):

        async def connect(path: str = path) -> tuple[bool, Any]:
            communicator = WebsocketCommunicator(app, path, headers=headers)
            connected, code = await communicator.connect()
            await communicator.disconnect()
            return connected, code

        connected, code = async_to_sync(connect)()
        if role == "anonymous":
            assert not connected and code == 4401, path
        else:
            assert connected, path


def test_redoc_sends_readers_to_swagger_ui_which_asks_nothing_of_a_third_party(client):  # noqa: ANN001
    moved = client.get("/api/redoc/")
    assert moved.status_code == 301 and moved["Location"] == "/api/docs/"
