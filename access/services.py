"""Personal API tokens: made by their user, shown once, stored as digests,
expiring, revocable; and the lookup every door (REST, websockets, the lean
generate path) authenticates with."""

from __future__ import annotations

import datetime as dt
import secrets
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.utils import timezone

from access.models import ApiToken
from common.errors import NotFound, PermissionDenied, ValidationFailed
from common.ttl_cache import MISSING, TtlCache
from core.events import record, source_of
from core.secrets import secret_digest

TOKEN_PREFIX = "gt-"
# Last use is written at most this often per token: a busy client must not
# turn every read into a write.
LAST_USED_EVERY = dt.timedelta(seconds=60)


@dataclass(frozen=True)
class NewToken:
    token: ApiToken
    secret: str  # shown once; only its digest is stored


def token_create(*, user: Any, name: str, expires_at: dt.datetime | None = None) -> NewToken:
    """A new token for ``user`` (who must be signed in and active)."""
    if not getattr(user, "is_authenticated", False) or not user.is_active:
        raise PermissionDenied("only a signed-in, active user may make a token")
    name = name.strip()
    if not name:
        raise ValidationFailed({"name": "may not be blank"})
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationFailed({"expires_at": "must be in the future"})
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with transaction.atomic():
        token = ApiToken.objects.create(
            user=user, name=name, prefix=secret[:10], digest=secret_digest(secret), expires_at=expires_at
        )
        record(
            kind="token.created",
            source=source_of(user),
            actor=user,
            message=f"{user.get_username()} made the API token {name!r} ({token.prefix}…)",
            data={"token": token.pk, "expires_at": expires_at.isoformat() if expires_at else None},
        )
    return NewToken(token=token, secret=secret)


def token_revoke(*, token_id: int, user: Any) -> ApiToken:
    """Revoke a token: its owner or an admin may. Revoking twice changes nothing."""
    from core.permissions import can_admin

    with transaction.atomic():
        token = ApiToken.objects.select_for_update().select_related("user").filter(pk=token_id).first()
        if token is None or (token.user_id != user.pk and not can_admin(user)):
            raise NotFound(f"token {token_id} does not exist")
        if token.revoked_at is None:
            token.revoked_at = timezone.now()
            token.save(update_fields=["revoked_at"])
            _recent.clear()  # at once in this process; within a second in the others
            record(
                kind="token.revoked",
                source=source_of(user),
                actor=user,
                message=f"{user.get_username()} revoked the API token {token.name!r} of {token.user.get_username()}",
                data={"token": token.pk},
            )
    return token


# Who each recently seen secret belongs to (by digest), kept a second per process.
_recent = TtlCache()


def token_user(secret: str) -> Any:
    """The active user a token's secret belongs to, or None: unknown, revoked,
    expired, or its user deactivated. Read at most once a second per token and
    process, so a revocation takes effect within a second everywhere."""
    if not secret or len(secret) > 200:
        return None
    digest = secret_digest(secret)
    found = _recent.get(digest, MISSING)
    return _recent.put(digest, _read_token_user(digest)) if found is MISSING else found


def token_user_if_known(secret: str) -> Any:
    """What token_user would answer, if it is known without the database; else MISSING."""
    return _recent.get(secret_digest(secret), MISSING) if secret and len(secret) <= 200 else None


def _read_token_user(digest: str) -> Any:
    token = ApiToken.objects.select_related("user").filter(digest=digest).first()
    if token is None or token.state != "active" or not token.user.is_active:
        return None
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at > LAST_USED_EVERY:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token.user


def bearer_secret(header: str) -> str | None:
    """The secret of an ``Authorization: Bearer <token>`` header (``Token <token>``,
    DRF's word, is accepted too), or None for any other header."""
    scheme, _, secret = header.partition(" ")
    if scheme not in ("Bearer", "Token"):
        return None
    return secret.strip() or None


def admin_ensure(*, username: str, password: str | None = None) -> str:
    """An admin (superuser) named ``username``, made with ``password`` (else one
    made up) unless one exists; says how to sign in, the made-up password this
    once. An existing user keeps its password."""
    from django.contrib.auth import get_user_model

    users = get_user_model()
    if users.objects.filter(username=username).exists():
        return f"Log in as {username!r} (existing user; its password is unchanged)."
    made = password or secrets.token_urlsafe(12)
    users.objects.create_superuser(username=username, email="", password=made)
    if password:
        return f"Log in as {username!r} with the password from GANTRY_ADMIN_PASSWORD."
    return f"Log in as {username!r} with password {made!r} (shown once; change it in the admin)."
