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
- And again every GANTRY_OIDC_RECHECK_MINUTES after (identity_recheck, from
  the periodic work): the refresh token of the last sign-in is exchanged at
  the provider and its userinfo read. A person demoted there loses the role
  here, with their API tokens and gateway keys (both follow the role); one
  removed, or in no mapped group any more, is made inactive: their sessions,
  tokens and keys stop. A provider that issues no refresh token gets
  sessions that last GANTRY_OIDC_RECHECK_MINUTES. A provider that cannot be
  reached changes nothing (the next check tries again).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.exceptions import SuspiciousOperation
from django.db import transaction
from django.db.models import Q
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils import timezone
from django.views import View
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.utils import import_from_settings
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from access.models import ExternalIdentity
from core.permissions import ADMIN_GROUP, OPERATOR_GROUP

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


class RecheckFailed(Exception):
    """The provider could not be asked (transient): nothing is changed."""


def identity_recheck(identity: ExternalIdentity) -> str:
    """Ask the provider again about ``identity`` (its refresh token), and make
    the person's Gantry roles what it says now. What was done, in words."""
    user = identity.user
    if not identity.refresh_token:
        return f"{user.get_username()}: no refresh token (their sessions end after GANTRY_OIDC_RECHECK_MINUTES)"
    try:
        document = discovery()
        answer = requests.post(
            document["token_endpoint"],
            data={"grant_type": "refresh_token", "refresh_token": identity.refresh_token},
            auth=(settings.GANTRY_OIDC_CLIENT_ID, settings.GANTRY_OIDC_CLIENT_SECRET),
            timeout=10,
        )
    except (ProviderUnreachable, requests.RequestException) as exc:
        raise RecheckFailed(f"the provider cannot be asked about {user.get_username()}: {exc}") from None
    if answer.status_code >= 500:
        raise RecheckFailed(f"the provider answered {answer.status_code} about {user.get_username()}")
    tokens = answer.json() if answer.ok else {}
    access_token = tokens.get("access_token")
    claims: dict[str, Any] = {}
    if access_token:
        try:
            info = requests.get(
                document["userinfo_endpoint"], headers={"Authorization": f"Bearer {access_token}"}, timeout=10
            )
        except requests.RequestException as exc:
            raise RecheckFailed(f"the provider's userinfo cannot be read for {user.get_username()}: {exc}") from None
        if info.status_code >= 500:
            raise RecheckFailed(f"the provider's userinfo answered {info.status_code}")
        claims = info.json() if info.ok else {}
    if str(claims.get("sub") or "") != identity.subject:
        # The refresh was refused (invalid_grant: removed, disabled, sessions revoked) or named someone else.
        why = (tokens.get("error") or f"HTTP {answer.status_code}") if not access_token else "its userinfo"
        return _identity_closed(identity, f"the provider no longer vouches for them ({why})")
    roles = roles_of(claims)
    if not roles:
        return _identity_closed(identity, "none of their provider groups maps to a Gantry role any more")
    with transaction.atomic():
        _sync_groups(user, roles)
        ExternalIdentity.objects.filter(pk=identity.pk).update(
            refresh_token=tokens.get("refresh_token") or identity.refresh_token, checked_at=timezone.now()
        )
    return f"{user.get_username()}: roles {', '.join(sorted(roles))}"


def _identity_closed(identity: ExternalIdentity, why: str) -> str:
    """The person keeps no access: their user inactive (sessions, API tokens and
    gateway keys stop with it), their roles gone, the refresh token forgotten."""
    user = identity.user
    with transaction.atomic():
        _sync_groups(user, set())
        type(user).objects.filter(pk=user.pk).update(is_active=False)
        ExternalIdentity.objects.filter(pk=identity.pk).update(refresh_token="", checked_at=timezone.now())
    log.warning("single sign-on: %s made inactive: %s", user.get_username(), why)
    return f"{user.get_username()}: made inactive: {why}"


def identities_recheck(*, force: bool = False) -> list[str]:
    """Every signed-in person whose last check is older than GANTRY_OIDC_RECHECK_MINUTES
    (all of them with ``force``), asked about again (the periodic work calls this)."""
    if not enabled():
        return []
    due = ExternalIdentity.objects.select_related("user").filter(issuer=_issuer(), user__is_active=True)
    if not force:
        stale = timezone.now() - timedelta(minutes=settings.GANTRY_OIDC_RECHECK_MINUTES)
        due = due.filter(Q(checked_at__isnull=True) | Q(checked_at__lt=stale))
    done = []
    for identity in due.exclude(refresh_token=""):
        try:
            done.append(identity_recheck(identity))
        except RecheckFailed as exc:
            log.warning("single sign-on: %s", exc)
            done.append(str(exc))
    return done


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

    def get_user(self, user_id: Any) -> Any:
        """The session's user, while active: mozilla-django-oidc's own answers an
        inactive one too, so a person made inactive kept their browser session."""
        user = super().get_user(user_id)
        return user if user is not None and user.is_active else None

    def get_token(self, payload: dict[str, Any]) -> dict[str, Any]:
        tokens = super().get_token(payload)
        self.refresh_token = str(tokens.get("refresh_token") or "")  # kept on the identity: see identity_recheck
        return tokens

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
            if not user.is_active:  # by an admin, or by a check: an admin lets them in again
                _refuse(self.request, f"{user.get_username()} is deactivated in Gantry: an admin may reactivate them")
            _sync_groups(user, roles)
            ExternalIdentity.objects.filter(pk=identity.pk).update(
                refresh_token=getattr(self, "refresh_token", ""), checked_at=timezone.now()
            )
            expiry = getattr(self.request.session, "set_expiry", None)
            if not getattr(self, "refresh_token", "") and expiry is not None:
                # No way to ask the provider again later: the session is as long as a check's interval.
                expiry(settings.GANTRY_OIDC_RECHECK_MINUTES * 60)
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
