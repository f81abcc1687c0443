"""Single sign-on with OpenID Connect (mozilla-django-oidc), beside local accounts.

- Configured by GANTRY_OIDC_ISSUER, its client id and secret; the provider's
  endpoints come from its discovery document, read on first use and kept an
  hour, so a local sign-in never waits on the provider (break-glass: local
  accounts keep working while the provider is down).
- The code flow with PKCE and a nonce; the ID token's signature (the
  provider's keys), issuer, audience and expiry are checked.
- A person is known by (issuer, subject), never by a name or an e-mail a
  provider could hand to someone else. The first sign-in makes a Gantry user
  with no password; a local account of the same name is not taken over (the
  new user gets another name).
- Roles come from the groups claim (GANTRY_OIDC_GROUPS_CLAIM) at every
  sign-in: GANTRY_OIDC_ADMIN_GROUPS, _OPERATOR_GROUPS and _VIEWER_GROUPS map
  the provider's groups to Gantry's admin and operator groups (and to
  viewing). Someone in none of them is refused, and says so on the sign-in
  page; a user made inactive in Gantry stays out.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.exceptions import SuspiciousOperation
from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.views import View
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.utils import import_from_settings
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from access.models import ExternalIdentity
from deployments.permissions import ADMIN_GROUP, OPERATOR_GROUP

log = logging.getLogger(__name__)
DISCOVERY_TTL_S = 3600.0
REFUSAL = "sso_refusal"  # the session key the sign-in page reads its message from
_discovered: tuple[float, dict[str, Any]] | None = None


class ProviderUnreachable(Exception):
    """The provider's discovery document could not be read; the message says why."""


def enabled() -> bool:
    return bool(settings.GANTRY_OIDC_ISSUER)


def _issuer() -> str:
    return settings.GANTRY_OIDC_ISSUER.rstrip("/")


def discovery() -> dict[str, Any]:
    """The provider's discovery document (cached DISCOVERY_TTL_S), checked to name
    the configured issuer."""
    global _discovered
    if _discovered is not None and time.monotonic() - _discovered[0] < DISCOVERY_TTL_S:
        return _discovered[1]
    url = f"{_issuer()}/.well-known/openid-configuration"
    try:
        answer = requests.get(url, timeout=10)
        answer.raise_for_status()
        document = answer.json()
    except (requests.RequestException, ValueError) as exc:
        raise ProviderUnreachable(f"the provider's discovery document at {url} could not be read: {exc}") from None
    if str(document.get("issuer", "")).rstrip("/") != _issuer():
        raise ProviderUnreachable(f"{url} names the issuer {document.get('issuer')!r}, not {_issuer()!r}")
    missing = [
        k for k in ("authorization_endpoint", "token_endpoint", "userinfo_endpoint", "jwks_uri") if k not in document
    ]
    if missing:
        raise ProviderUnreachable(f"{url} lacks {', '.join(missing)}")
    _discovered = (time.monotonic(), document)
    return document


_FROM_DISCOVERY = {
    "OIDC_OP_AUTHORIZATION_ENDPOINT": "authorization_endpoint",
    "OIDC_OP_TOKEN_ENDPOINT": "token_endpoint",
    "OIDC_OP_USER_ENDPOINT": "userinfo_endpoint",
    "OIDC_OP_JWKS_ENDPOINT": "jwks_uri",
}


def setting(attr: str, *args: Any) -> Any:
    """mozilla-django-oidc's settings, with the provider's endpoints from discovery."""
    if attr in _FROM_DISCOVERY:
        return discovery()[_FROM_DISCOVERY[attr]]
    return import_from_settings(attr, *args)


def roles_of(claims: dict[str, Any]) -> set[str]:
    """Gantry's roles ("admin", "operator", "viewer") for the provider's groups claim."""
    groups = claims.get(settings.GANTRY_OIDC_GROUPS_CLAIM) or []
    if isinstance(groups, str):
        groups = [groups]
    groups = {str(g) for g in groups}
    roles = set()
    for role, mapped in (
        ("admin", settings.GANTRY_OIDC_ADMIN_GROUPS),
        ("operator", settings.GANTRY_OIDC_OPERATOR_GROUPS),
        ("viewer", settings.GANTRY_OIDC_VIEWER_GROUPS),
    ):
        if "*" in mapped or groups & set(mapped):
            roles.add(role)
    return roles


def _refuse(request: HttpRequest, message: str) -> None:
    request.session[REFUSAL] = message
    raise SuspiciousOperation(message)


class Backend(OIDCAuthenticationBackend):
    """Signs in the person the provider vouches for (the callback's code), with
    the roles their groups map to. Answers nothing to a user name and password."""

    get_settings = staticmethod(setting)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Not the parent's: it reads the provider's endpoints, and Django makes every
        # backend for every sign-in, local ones included.
        self.UserModel = get_user_model()

    def authenticate(self, request: HttpRequest | None, **kwargs: Any) -> Any:
        if not enabled() or request is None or "code" not in request.GET:
            return None
        document = discovery()
        self.OIDC_OP_TOKEN_ENDPOINT = document["token_endpoint"]
        self.OIDC_OP_USER_ENDPOINT = document["userinfo_endpoint"]
        self.OIDC_OP_JWKS_ENDPOINT = document["jwks_uri"]
        self.OIDC_RP_CLIENT_ID = settings.GANTRY_OIDC_CLIENT_ID
        self.OIDC_RP_CLIENT_SECRET = settings.GANTRY_OIDC_CLIENT_SECRET
        self.OIDC_RP_SIGN_ALGO = settings.OIDC_RP_SIGN_ALGO
        self.OIDC_RP_IDP_SIGN_KEY = None
        return super().authenticate(request, **kwargs)

    def verify_token(self, token: str, **kwargs: Any) -> dict[str, Any]:
        payload = super().verify_token(token, **kwargs)  # the signature and the nonce
        audience = payload.get("aud")
        audiences = audience if isinstance(audience, list) else [audience]
        if str(payload.get("iss", "")).rstrip("/") != _issuer():
            _refuse(self.request, f"the ID token was issued by {payload.get('iss')!r}, not {_issuer()!r}")
        if settings.GANTRY_OIDC_CLIENT_ID not in audiences:
            _refuse(self.request, "the ID token is not meant for Gantry (its audience)")
        if float(payload.get("exp", 0)) < time.time():
            _refuse(self.request, "the ID token has expired")
        return payload

    def get_or_create_user(self, access_token: str, id_token: str, payload: dict[str, Any]) -> Any:
        claims = {**payload, **self.get_userinfo(access_token, id_token, payload)}
        subject = str(claims.get("sub") or "")
        if not subject or subject != str(payload.get("sub")):
            _refuse(self.request, "the provider's answers do not name the same person")
        roles = roles_of(claims)
        name = str(claims.get("preferred_username") or claims.get("email") or subject)
        if not roles:
            _refuse(self.request, f"{name} has no Gantry role: none of their groups is mapped to one")
        with transaction.atomic():
            identity = ExternalIdentity.objects.select_related("user").filter(issuer=_issuer(), subject=subject).first()
            if identity is None:
                user = self.UserModel(username=_free_username(name), email=str(claims.get("email") or ""))
                user.set_unusable_password()
                user.save()
                identity = ExternalIdentity.objects.create(user=user, issuer=_issuer(), subject=subject)
            user = identity.user
            if not user.is_active:
                _refuse(self.request, f"{user.get_username()} is deactivated in Gantry")
            _sync_groups(user, roles)
        log.info("single sign-on: %s (%s) with roles %s", user.get_username(), subject, ", ".join(sorted(roles)))
        return user


def _free_username(name: str) -> str:
    """``name`` (150 characters at most), or with a number after it when a user has it already."""
    users = get_user_model().objects
    base = name[:140]
    candidate, n = base, 1
    while users.filter(username=candidate).exists():
        n += 1
        candidate = f"{base}-{n}"
    return candidate


def _sync_groups(user: Any, roles: set[str]) -> None:
    """The user's admin and operator groups follow the provider's, every sign-in."""
    for role, group_name in (("admin", ADMIN_GROUP), ("operator", OPERATOR_GROUP)):
        group, _ = Group.objects.get_or_create(name=group_name)
        if role in roles:
            user.groups.add(group)
        else:
            user.groups.remove(group)


class Authenticate(OIDCAuthenticationRequestView):
    """GET /oidc/authenticate/: off to the provider (404 while single sign-on is off)."""

    get_settings = staticmethod(setting)

    def __init__(self, **kwargs: Any) -> None:
        View.__init__(self, **kwargs)  # the endpoints are read in get(), where a failure can be said

    def get(self, request: HttpRequest) -> HttpResponse:
        if not enabled():
            raise Http404("single sign-on is not configured")
        try:
            self.OIDC_OP_AUTH_ENDPOINT = discovery()["authorization_endpoint"]
        except ProviderUnreachable as exc:
            log.warning("single sign-on: %s", exc)
            request.session[REFUSAL] = (
                f"{settings.GANTRY_OIDC_NAME} cannot be reached now: sign in with a local account"
            )
            return HttpResponseRedirect(reverse("login"))
        self.OIDC_RP_CLIENT_ID = settings.GANTRY_OIDC_CLIENT_ID
        return super().get(request)


class Callback(OIDCAuthenticationCallbackView):
    """GET /oidc/callback/: the provider's answer; a refusal is said on the sign-in page."""

    get_settings = staticmethod(setting)

    def get(self, request: HttpRequest) -> HttpResponse:
        if not enabled():
            raise Http404("single sign-on is not configured")
        if "error" in request.GET:
            request.session[REFUSAL] = (
                f"{settings.GANTRY_OIDC_NAME} refused: {request.GET.get('error_description') or request.GET['error']}"
            )
        return super().get(request)

    @property
    def failure_url(self) -> str:
        self.request.session.setdefault(REFUSAL, f"signing in with {settings.GANTRY_OIDC_NAME} failed")
        return reverse("login")
