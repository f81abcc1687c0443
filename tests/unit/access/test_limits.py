"""Abuse limits and transport security: API throttles, sign-in lockout, and
`check --deploy` clean with nothing but DEBUG off."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth.signals import user_login_failed
from django.core.cache import caches
from rest_framework.test import APIClient

from access.models import SignInFailures

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _fresh_counters():
    caches["shared"].clear()
    yield
    caches["shared"].clear()


def test_a_user_over_the_api_rate_gets_429_with_retry_after(settings, viewer):  # noqa: ANN001
    settings.GANTRY_API_THROTTLE = "3/minute"
    client = APIClient()
    client.force_authenticate(viewer)
    assert [client.get("/api/hosts/").status_code for _ in range(3)] == [200, 200, 200]
    refused = client.get("/api/hosts/")
    assert refused.status_code == 429 and int(refused["Retry-After"]) > 0
    assert refused.json()["code"] == "throttled"


def test_throttling_can_be_turned_off(settings, viewer):  # noqa: ANN001
    settings.GANTRY_API_THROTTLE = "off"
    client = APIClient()
    client.force_authenticate(viewer)
    assert {client.get("/api/hosts/").status_code for _ in range(5)} == {200}


def test_sign_in_locks_after_repeated_failures_even_with_the_right_password(settings, client, viewer):  # noqa: ANN001
    settings.GANTRY_LOGIN_ATTEMPTS = 3
    for _ in range(3):
        assert client.post("/login/", {"username": viewer.username, "password": "wrong"}).status_code == 200
    locked = client.post("/login/", {"username": viewer.username, "password": "viewer-pass"})
    assert locked.status_code == 429 and b"Too many failed sign-ins" in locked.content
    assert "_auth_user_id" not in client.session


def _page(response) -> str:  # noqa: ANN001 - the page without its per-response CSRF token
    return re.sub(r'name="csrfmiddlewaretoken" value="[^"]+"', "", response.content.decode())


def test_a_locked_account_answers_the_same_whatever_the_password_without_checking_it(settings, client, viewer):  # noqa: ANN001
    settings.GANTRY_LOGIN_ATTEMPTS = 2
    for _ in range(2):
        client.post("/login/", {"username": viewer.username, "password": "wrong"})
    checked = []
    user_login_failed.connect(lambda **kw: checked.append(kw), weak=False, dispatch_uid="count-checks")
    try:
        right = client.post("/login/", {"username": viewer.username, "password": "viewer-pass"})
        wrong = client.post("/login/", {"username": viewer.username, "password": "still wrong"})
    finally:
        user_login_failed.disconnect(dispatch_uid="count-checks")
    assert right.status_code == wrong.status_code == 429
    assert _page(right) == _page(wrong)  # nothing tells the right password apart
    assert "enter a correct username" not in _page(wrong)
    assert checked == []  # no password was checked while locked
    assert 0 < int(right["Retry-After"]) <= settings.GANTRY_LOGIN_LOCKOUT_S
    # From another address too: the account is locked, not the pair.
    other = client.post("/login/", {"username": viewer.username, "password": "viewer-pass"}, REMOTE_ADDR="10.9.9.9")
    assert other.status_code == 429


def test_a_password_spray_from_one_address_is_refused_after_its_limit(settings, client, viewer, operator):  # noqa: ANN001
    settings.GANTRY_LOGIN_ADDRESS_ATTEMPTS = 3
    for name in ("alice", "bob", "carol"):  # one guess each at many accounts
        assert client.post("/login/", {"username": name, "password": "Winter2026"}).status_code == 200
    sprayed = client.post("/login/", {"username": operator.username, "password": "operator-pass"})
    assert sprayed.status_code == 429 and int(sprayed["Retry-After"]) > 0
    # Another address is not refused, and a success there does not reset this address's count.
    elsewhere = client.post("/login/", {"username": viewer.username, "password": "viewer-pass"}, REMOTE_ADDR="10.9.9.9")
    assert elsewhere.status_code == 302
    assert client.post("/login/", {"username": "dave", "password": "x"}).status_code == 429


def test_a_successful_sign_in_clears_the_failures(settings, client, viewer):  # noqa: ANN001
    settings.GANTRY_LOGIN_ATTEMPTS = 3
    for _ in range(2):
        client.post("/login/", {"username": viewer.username, "password": "wrong"})
    assert client.post("/login/", {"username": viewer.username, "password": "viewer-pass"}).status_code == 302
    client.logout()
    for _ in range(2):
        client.post("/login/", {"username": viewer.username, "password": "wrong"})
    assert client.post("/login/", {"username": viewer.username, "password": "viewer-pass"}).status_code == 302


def test_the_admin_signs_in_through_the_same_form(client):  # noqa: ANN001
    response = client.get("/admin/login/?next=/admin/")
    assert response.status_code == 302 and response["Location"].startswith("/login/?next=")


def _manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GANTRY_", "DEBUG", "DJANGO"))}
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env={**base, **env}, capture_output=True, text=True
    )


def test_check_deploy_finds_nothing_with_debug_off_and_no_other_setting(tmp_path):  # noqa: ANN001
    run = _manage(
        "check",
        "--deploy",
        "--fail-level",
        "WARNING",
        SECRET_KEY="k" * 30 + "-Z9!x" * 10,
        GANTRY_DATA_DIR=str(tmp_path),
    )
    assert run.returncode == 0 and "no issues" in run.stdout, run.stdout + run.stderr


def test_plain_http_is_redirected_unless_the_setup_opts_out(settings, client, db):  # noqa: ANN001
    settings.SECURE_SSL_REDIRECT = True
    response = client.get("/login/")
    assert response.status_code == 301 and response["Location"].startswith("https://")
    assert client.get("/healthz").json() == {"status": "ok"}


def test_a_lockout_lives_in_the_database_and_outlasts_a_redis_restart(settings, client, viewer):  # noqa: ANN001
    """Counted in the database, not in Redis: a restart (or an outage) of Redis
    neither wipes a running lockout nor turns the count off."""
    settings.GANTRY_LOGIN_ATTEMPTS = 2
    for _ in range(2):
        client.post("/login/", {"username": viewer.username, "password": "wrong"})
    assert SignInFailures.objects.get(key=f"user:{viewer.username}").failures == 2
    caches["shared"].clear()  # what a Redis restart leaves
    locked = client.post("/login/", {"username": viewer.username, "password": "viewer-pass"})
    assert locked.status_code == 429
