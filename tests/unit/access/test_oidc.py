"""Single sign-on's rules without a provider's sign-in (the browser test,
tests/integration/test_sso.py, runs the whole flow against a real one): roles
from groups, discovery checked against the issuer, an unreachable provider
said on the sign-in page, no takeover of a local account's name, and no
button while it is off."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator

import pytest
from django.contrib.auth.models import User

from access import oidc
from access.models import ExternalIdentity

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_discovery(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oidc, "_discovered", None)


@pytest.fixture
def sso(settings):  # noqa: ANN001, ANN201
    settings.GANTRY_OIDC_ISSUER = "http://127.0.0.1:9/o"
    settings.GANTRY_OIDC_CLIENT_ID, settings.GANTRY_OIDC_CLIENT_SECRET = "gantry", "s"
    settings.GANTRY_OIDC_NAME = "Corp SSO"
    settings.GANTRY_OIDC_ADMIN_GROUPS = ["platform"]
    settings.GANTRY_OIDC_OPERATOR_GROUPS = ["ml", "ml-leads"]
    settings.GANTRY_OIDC_VIEWER_GROUPS = []
    return settings


def test_roles_follow_the_groups_claim(sso) -> None:  # noqa: ANN001
    assert oidc.roles_of({"groups": ["ml"]}) == {"operator"}
    assert oidc.roles_of({"groups": ["platform", "ml-leads"]}) == {"admin", "operator"}
    assert oidc.roles_of({"groups": "platform"}) == {"admin"}  # a single group as a string
    assert oidc.roles_of({"groups": ["finance"]}) == set() and oidc.roles_of({}) == set()
    sso.GANTRY_OIDC_VIEWER_GROUPS = ["*"]
    assert oidc.roles_of({}) == {"viewer"}
    sso.GANTRY_OIDC_GROUPS_CLAIM = "roles"
    assert oidc.roles_of({"roles": ["ml"], "groups": ["platform"]}) == {"operator", "viewer"}


@pytest.fixture
def document_server() -> Iterator[tuple[str, dict]]:
    """A real HTTP server answering the discovery document held in the dict it yields."""
    served: dict = {}

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = json.dumps(served).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/o", served
    server.shutdown()


def test_discovery_must_name_the_configured_issuer_and_every_endpoint(sso, document_server) -> None:  # noqa: ANN001
    issuer, served = document_server
    sso.GANTRY_OIDC_ISSUER = issuer
    served.update(issuer="http://elsewhere/o")
    with pytest.raises(oidc.ProviderUnreachable, match="names the issuer 'http://elsewhere/o'"):
        oidc.discovery()
    served.update(issuer=issuer, authorization_endpoint=f"{issuer}/authorize/")
    with pytest.raises(oidc.ProviderUnreachable, match="lacks token_endpoint, userinfo_endpoint, jwks_uri"):
        oidc.discovery()
    served.update(token_endpoint="t", userinfo_endpoint="u", jwks_uri="j")
    assert oidc.setting("OIDC_OP_JWKS_ENDPOINT") == "j"
    assert oidc.setting("OIDC_RP_SIGN_ALGO") == "RS256"  # the rest from Django's settings


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_unreachable_provider_is_said_on_the_sign_in_page_and_local_sign_in_never_asks_it(sso, client) -> None:  # noqa: ANN001
    sso.GANTRY_OIDC_ISSUER = f"http://127.0.0.1:{_closed_port()}/o"
    User.objects.create_user("local-admin", password="break-glass-pass")
    went = client.get("/oidc/authenticate/")
    assert went.status_code == 302 and went["Location"] == "/login/"
    page = client.get("/login/").content.decode()
    assert "Corp SSO cannot be reached now: sign in with a local account" in page
    assert "Sign in with Corp SSO" in page
    signed_in = client.post("/login/", {"username": "local-admin", "password": "break-glass-pass"})
    assert signed_in.status_code == 302  # the provider's backend answered nothing, and asked nothing


def test_no_button_and_no_route_while_single_sign_on_is_off(client, settings) -> None:  # noqa: ANN001
    settings.GANTRY_OIDC_ISSUER = ""
    assert "Sign in with" not in client.get("/login/").content.decode()
    assert client.get("/oidc/authenticate/").status_code == 404


def test_a_new_person_never_takes_a_local_accounts_name(sso, rf) -> None:  # noqa: ANN001
    User.objects.create_user("alice", password="local")
    backend = oidc.Backend()
    backend.request = rf.get("/oidc/callback/")
    backend.request.session = {}
    backend.get_userinfo = lambda *args: {"preferred_username": "alice", "groups": ["ml"]}
    user = backend.get_or_create_user("access", "id", {"sub": "42"})
    assert user.username == "alice-2" and not user.has_usable_password()
    assert [g.name for g in user.groups.all()] == ["gantry-operators"]
    assert ExternalIdentity.objects.get(subject="42").user == user
    # The same person again, now without the group: the role goes.
    backend.get_userinfo = lambda *args: {"preferred_username": "alice", "groups": ["platform"]}
    again = backend.get_or_create_user("access", "id", {"sub": "42"})
    assert again == user and [g.name for g in again.groups.all()] == ["gantry-admins"]
    # Deactivated in Gantry: refused, whatever the provider says.
    User.objects.filter(pk=user.pk).update(is_active=False)
    with pytest.raises(Exception, match="deactivated"):
        backend.get_or_create_user("access", "id", {"sub": "42"})
    assert "deactivated" in backend.request.session[oidc.REFUSAL]


def test_a_provider_that_cannot_be_asked_changes_nobodys_access(sso) -> None:  # noqa: ANN001
    from django.contrib.auth.models import Group

    from core.permissions import OPERATOR_GROUP, can_operate

    user = User.objects.create_user("carol")
    user.groups.add(Group.objects.get_or_create(name=OPERATOR_GROUP)[0])
    ExternalIdentity.objects.create(user=user, issuer="http://127.0.0.1:9/o", subject="c-1", refresh_token="r")
    said = oidc.identities_recheck()  # port 9 answers nothing
    assert len(said) == 1 and "cannot be asked" in said[0]
    user.refresh_from_db()
    assert user.is_active and can_operate(user)
    assert ExternalIdentity.objects.get(subject="c-1").refresh_token == "r"
