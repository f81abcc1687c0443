"""Single sign-on in the browser, for real: django-oauth-toolkit's OpenID
provider runs as its own Django server (tests/fixtures/oidc_provider), and
Gantry's web server is configured to trust it. A person in the provider's
``ml-operators`` group signs in with it and gets Gantry's operator role; a
person in no mapped group is refused with the reason on the sign-in page; a
local account still signs in with the provider stopped (break-glass). A
person demoted at the provider loses the role at the next check, with their
gateway key; one removed there loses every access, API tokens included."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from django.contrib.auth.models import User

from tests.integration.conftest import ROOT, Stack, _spawn, free_port, make_stack, manage, stop_process, wait_for

pytestmark = [pytest.mark.integration]

CLIENT_ID, CLIENT_SECRET = "gantry-web", "sso-test-client-secret"
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture
def provider_port() -> int:
    return free_port()


@pytest.fixture
def sso_stack(transactional_db, tmp_path: Path, operator: User, provider_port: int) -> Iterator[Stack]:  # noqa: ANN001
    env = {
        "GANTRY_OIDC_ISSUER": f"http://127.0.0.1:{provider_port}/o",
        "GANTRY_OIDC_CLIENT_ID": CLIENT_ID,
        "GANTRY_OIDC_CLIENT_SECRET": CLIENT_SECRET,
        "GANTRY_OIDC_NAME": "Test IdP",
        "GANTRY_OIDC_OPERATOR_GROUPS": "ml-operators",
        "GANTRY_OIDC_VIEWER_GROUPS": "ml-viewers",
    }
    yield from make_stack(tmp_path, operator, extra_env=env)


@pytest.fixture
def provider(sso_stack: Stack, tmp_path: Path, provider_port: int) -> Iterator[subprocess.Popen]:
    """The provider's own server, its client for this Gantry and its two users."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    env = {
        **os.environ,
        "PYTHONPATH": str(FIXTURES),
        "DJANGO_SETTINGS_MODULE": "oidc_provider.settings",
        "OIDC_PROVIDER_DB": str(tmp_path / "provider.sqlite3"),
        "OIDC_PROVIDER_KEY": key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode(),
    }
    subprocess.run([sys.executable, "-m", "oidc_provider.setup", sso_stack.web_url, CLIENT_ID, CLIENT_SECRET],
                   env=env, check=True, cwd=FIXTURES)  # fmt: skip
    argv = [sys.executable, "-m", "django", "runserver", f"127.0.0.1:{provider_port}", "--noreload", "--nothreading"]
    server = _spawn(argv, env, sso_stack.log_dir / "provider.log")
    server.env = env  # type: ignore[attr-defined] - for _at_the_provider
    discovery = f"http://127.0.0.1:{provider_port}/o/.well-known/openid-configuration"
    wait_for(lambda: _answers(discovery), 30, "the OpenID provider")
    try:
        yield server
    finally:
        stop_process(server)


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).ok
    except requests.ConnectionError:
        return False


def _sign_in_at_the_provider(page, username: str) -> None:  # noqa: ANN001 - Playwright's Page
    """From Gantry's sign-in page: its single sign-on button, then the provider's own form."""
    page.click("#sso")
    page.wait_for_url("**/accounts/login/**")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", "provider-pass")
    page.click("#provider-login")


def _groups(stack: Stack, username: str) -> str:
    script = (
        "from django.contrib.auth.models import User; "
        f"u = User.objects.get(username='{username}'); "
        "print(sorted(g.name for g in u.groups.all()), u.has_usable_password(), "
        "[i.subject for i in u.external_identities.all()])"
    )
    return manage(stack.env, "shell", "-c", script).splitlines()[-1]


def test_a_provider_group_becomes_a_gantry_role_and_local_accounts_stay_for_break_glass(
    sso_stack: Stack,
    provider: subprocess.Popen,
    page,
    screenshot,  # noqa: ANN001
):
    base = sso_stack.web_url
    page.goto(f"{base}/login/")
    button = page.locator("#sso")
    assert button.inner_text() == "Sign in with Test IdP"
    screenshot("login-with-sso")

    # alice, in the provider's ml-operators group: Gantry's operator, without a password of Gantry's.
    _sign_in_at_the_provider(page, "alice")
    page.wait_for_url(f"{base}/")
    assert "Log out alice" in page.locator("nav").inner_text()
    assert _groups(sso_stack, "alice").startswith("['gantry-operators'] False ['")
    page.click("text=Log out alice")

    # outsider, in no mapped group: refused, and told why, on Gantry's sign-in page.
    page.context.clear_cookies()  # alice's session at the provider too
    page.goto(f"{base}/login/")
    _sign_in_at_the_provider(page, "outsider")
    page.wait_for_url(f"{base}/login/**")
    refusal = page.locator("[role=alert]").inner_text()
    assert "outsider has no Gantry role" in refusal, refusal
    screenshot("login-sso-refused")

    # The provider goes away: a local account still signs in.
    stop_process(provider)
    page.goto(f"{base}/login/")
    page.fill("input[name=username]", sso_stack.user.username)
    page.fill("input[name=password]", "operator-pass")
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/")
    assert f"Log out {sso_stack.user.username}" in page.locator("nav").inner_text()


def _at_the_provider(provider: subprocess.Popen, code: str) -> None:
    """Run ``code`` in the provider's Django (its users and groups), as its admin would."""
    subprocess.run([sys.executable, "-m", "django", "shell", "-c", code], env=provider.env, check=True, cwd=FIXTURES,
                   capture_output=True, timeout=60)  # fmt: skip


def _gantry(stack: Stack, code: str) -> str:
    return manage(stack.env, "shell", "-c", code).strip().splitlines()[-1]


def test_a_person_demoted_or_removed_at_the_provider_loses_access_at_the_next_check(
    sso_stack: Stack,
    provider: subprocess.Popen,
    page,  # noqa: ANN001
):
    base = sso_stack.web_url
    _at_the_provider(
        provider,
        "from django.contrib.auth.models import Group, User; "
        "User.objects.get(username='alice').groups.add(Group.objects.create(name='ml-viewers'))",
    )
    page.goto(f"{base}/login/")
    _sign_in_at_the_provider(page, "alice")
    page.wait_for_url(f"{base}/")
    # What alice's automation holds: a personal token and a gateway key, made while she is an operator.
    token, key = _gantry(sso_stack, (
        "from django.contrib.auth.models import User; from access.services import token_create; "
        "from gateway.services import key_create; u = User.objects.get(username='alice'); "
        "print(token_create(user=u, name='ci').secret, key_create(name='app', user=u, all_aliases=True).secret)"
    )).split()  # fmt: skip
    bearer = {"Authorization": f"Bearer {token}"}
    assert requests.get(f"{base}/api/deployments/", headers=bearer, timeout=10).status_code == 200
    assert requests.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code == 200
    recheck = "from access.oidc import identities_recheck; print(identities_recheck(force=True))"

    # Demoted at the provider (out of ml-operators, still in ml-viewers): a viewer at the next check.
    _at_the_provider(
        provider,
        "from django.contrib.auth.models import Group, User; "
        "User.objects.get(username='alice').groups.remove(Group.objects.get(name='ml-operators'))",
    )
    assert "alice: roles viewer" in _gantry(sso_stack, recheck)
    assert _groups(sso_stack, "alice").startswith("[] False")
    assert requests.get(f"{base}/api/deployments/", headers=bearer, timeout=10).status_code == 200
    refused = requests.post(f"{base}/api/deployments/", json={"name": "x", "models": []}, headers=bearer, timeout=10)
    assert refused.status_code == 403, refused.text
    # Her gateway key stops with the operator role (within the gateway's second of caching).
    wait_for(lambda: requests.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"},
                                  timeout=10).status_code == 401, 10, "her gateway key to stop")  # fmt: skip

    # Removed at the provider: at the next check, nothing of hers answers any more.
    _at_the_provider(
        provider, "from django.contrib.auth.models import User; User.objects.get(username='alice').delete()"
    )
    assert "alice: made inactive: the provider no longer vouches for them" in _gantry(sso_stack, recheck)
    wait_for(lambda: requests.get(f"{base}/api/deployments/", headers=bearer, timeout=10).status_code == 401, 10,
             "her API token to stop")  # fmt: skip
    page.goto(f"{base}/")  # her browser session too
    page.wait_for_url("**/login/**")
