"""Personal API tokens: shown once, stored as digests, expiring, revocable,
and the one way automation authenticates on every door."""

from __future__ import annotations

import datetime as dt

from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.test import APIClient

from access.models import ApiToken
from access.services import token_create
from core.models import Event
from core.secrets import secret_digest


def _bearer(secret: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


def test_a_token_made_through_the_api_is_shown_once_and_stored_as_a_digest(viewer):  # noqa: ANN001
    client = APIClient()
    client.force_authenticate(viewer)
    created = client.post("/api/tokens/", {"name": "ci"}, format="json")
    assert created.status_code == 201
    secret = created.json()["token"]
    assert secret.startswith("gt-") and created.json()["state"] == "active"
    stored = ApiToken.objects.get(pk=created.json()["id"])
    assert stored.digest == secret_digest(secret) and secret not in str(stored.__dict__)
    assert "token" not in client.get(f"/api/tokens/{stored.pk}/").json()
    assert secret not in str(list(Event.objects.values_list("message", "data")))
    assert _bearer(secret).get("/api/deployments/").status_code == 200
    assert ApiToken.objects.get(pk=stored.pk).last_used_at is not None


def test_drfs_token_keyword_is_accepted_too(viewer):  # noqa: ANN001
    secret = token_create(user=viewer, name="old").secret
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {secret}")
    assert client.get("/api/hosts/").status_code == 200


def test_revoked_expired_and_unknown_tokens_are_401(viewer):  # noqa: ANN001
    revoked = token_create(user=viewer, name="r")
    client = APIClient()
    client.force_authenticate(viewer)
    assert client.post(f"/api/tokens/{revoked.token.pk}/revoke/").json()["state"] == "revoked"
    expired = token_create(user=viewer, name="e", expires_at=timezone.now() + dt.timedelta(seconds=60))
    ApiToken.objects.filter(pk=expired.token.pk).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    for secret in (revoked.secret, expired.secret, "gt-not-a-token"):
        response = _bearer(secret).get("/api/hosts/")
        assert response.status_code == 401 and response.json()["code"] == "authentication_failed"


def test_a_deactivated_users_token_stops_working(viewer):  # noqa: ANN001
    secret = token_create(user=viewer, name="t").secret
    User.objects.filter(pk=viewer.pk).update(is_active=False)
    assert _bearer(secret).get("/api/hosts/").status_code == 401


def test_an_expiry_in_the_past_is_refused_by_name(viewer):  # noqa: ANN001
    client = APIClient()
    client.force_authenticate(viewer)
    response = client.post("/api/tokens/", {"name": "x", "expires_at": "2020-01-01T00:00:00Z"}, format="json")
    assert response.status_code == 400 and response.json()["errors"] == {"expires_at": ["must be in the future"]}
    assert not ApiToken.objects.exists()


def test_people_see_and_revoke_only_their_own_tokens_and_admins_everyones(viewer, operator):  # noqa: ANN001
    mine = token_create(user=viewer, name="mine").token
    theirs = token_create(user=operator, name="theirs").token
    client = APIClient()
    client.force_authenticate(viewer)
    assert [t["name"] for t in client.get("/api/tokens/").json()["results"]] == ["mine"]
    assert client.get(f"/api/tokens/{theirs.pk}/").status_code == 404
    assert client.post(f"/api/tokens/{theirs.pk}/revoke/").status_code == 404
    assert ApiToken.objects.get(pk=theirs.pk).revoked_at is None
    admin = User.objects.create_superuser("root", password="pw")
    client.force_authenticate(admin)
    assert {t["name"] for t in client.get("/api/tokens/").json()["results"]} == {"mine", "theirs"}
    assert client.post(f"/api/tokens/{mine.pk}/revoke/").json()["state"] == "revoked"
    assert Event.objects.filter(kind="token.revoked", actor=admin).count() == 1


def test_the_tokens_page_shows_a_new_secret_once(client, viewer):  # noqa: ANN001
    client.force_login(viewer)
    made = client.post("/tokens/", {"action": "create", "name": "laptop", "lifetime": "30"})
    assert made.status_code == 302
    shown = client.get("/tokens/").content.decode()
    secret = shown.split('id="new-secret">')[1].split("<")[0]
    assert _bearer(secret).get("/api/hosts/").status_code == 200
    assert secret not in client.get("/tokens/").content.decode()
    token = ApiToken.objects.get(name="laptop")
    assert dt.timedelta(days=29) < token.expires_at - timezone.now() <= dt.timedelta(days=30)


def test_a_token_in_use_stops_working_when_revoked(viewer):  # noqa: ANN001
    made = token_create(user=viewer, name="busy")
    assert _bearer(made.secret).get("/api/hosts/").status_code == 200  # now remembered for a second
    owner = APIClient()
    owner.force_authenticate(viewer)
    owner.post(f"/api/tokens/{made.token.pk}/revoke/")
    assert _bearer(made.secret).get("/api/hosts/").status_code == 401


def test_a_gateway_key_on_the_rest_api_is_told_what_opens_it(operator):  # noqa: ANN001
    from gateway.services import key_create

    secret = key_create(name="app", user=operator, all_aliases=True).secret
    refused = _bearer(secret).get("/api/deployments/")
    assert refused.status_code == 401
    assert "gateway key (gk-…)" in str(refused.json()) and "gantry token" in str(refused.json())
