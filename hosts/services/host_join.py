"""Joining GPU hosts: an admin makes a one-time join token, the host trades it
(``gantry join``) for a database role and a Redis user of its own, and an
admin can revoke them. The control plane's own database password and secret
key never leave it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from common import pki
from common.errors import NotFound, PermissionDenied, ValidationFailed
from core import events, queues
from core.permissions import can_admin
from core.secrets import secret_digest
from core.validation import slug_validator
from hosts import grants
from hosts.models import GpuHost, HostCredential, HostJoinToken
from hosts.services import channel

TOKEN_PREFIX = "gj-"
JOIN_TOKEN_MINUTES_MAX = 7 * 24 * 60
RESERVED_NAMES = frozenset({"join", "join-tokens"})
ADMIN_REQUIRED = "joining and revoking GPU hosts needs the admin role"


@dataclass(frozen=True)
class JoinToken:
    secret: str  # shown once
    row: HostJoinToken


@dataclass(frozen=True)
class Joined:
    """What a host needs to connect: its own URLs and the settings it must share with the control plane."""

    host: GpuHost
    database_url: str
    redis_url: str
    settings: dict[str, str]
    certificate: str = ""  # its channel certificate (PEM), signed for the request it sent
    trust: str = ""  # the channel authority's certificate and revocation list (PEM)


def _require_admin(user: Any) -> None:
    if user is not None and not can_admin(user):
        raise PermissionDenied(ADMIN_REQUIRED)


def _valid_host_name(name: str, field: str) -> str:
    from django.core.exceptions import ValidationError

    try:
        slug_validator(name)
    except ValidationError:
        raise ValidationFailed({field: f"'{name}' is not a host name: {slug_validator.message}"}) from None
    if name in RESERVED_NAMES:
        raise ValidationFailed({field: f"'{name}' is reserved by the API (/api/hosts/{name}/)"})
    if name.endswith(queues.RESERVED_SUFFIXES):
        ends = ", ".join(f"'{s}'" for s in queues.RESERVED_SUFFIXES)
        raise ValidationFailed({field: f"'{name}' may not end in {ends}: its queues would be another host's"})
    return name


def host_join_token_create(*, user: Any, host_name: str = "", minutes: int = 60) -> JoinToken:
    """A one-time join token, valid for ``minutes``, for ``host_name`` (or any name)."""
    _require_admin(user)
    if host_name:
        _valid_host_name(host_name, "host")
    if not 1 <= minutes <= JOIN_TOKEN_MINUTES_MAX:
        raise ValidationFailed({"expires_in_minutes": f"must be between 1 and {JOIN_TOKEN_MINUTES_MAX} (a week)"})
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with transaction.atomic():
        row = HostJoinToken.objects.create(
            token_sha256=secret_digest(secret),
            host_name=host_name,
            created_by=events.signed_in(user),
            expires_at=timezone.now() + timedelta(minutes=minutes),
        )
        events.record(
            kind="host.join_token",
            source=events.source_of(user),
            actor=user,
            message=f"a join token for {host_name or 'any host name'}, valid until {row.expires_at:%Y-%m-%d %H:%M} UTC",
        )
    return JoinToken(secret=secret, row=row)


def _with_credentials(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    where = parts.hostname or ""
    if ":" in where:
        where = f"[{where}]"
    if parts.port:
        where = f"{where}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{where}"))


def _shared_settings(gateway_url: str) -> dict[str, str]:
    """Settings a host must agree on with the control plane."""
    return {
        "GANTRY_ALLOWED_IMAGES": ",".join(settings.GANTRY_ALLOWED_IMAGES),
        "GANTRY_BUILDER_IMAGES": ",".join(f"{i}={v}" for i, v in settings.GANTRY_BUILDER_IMAGES.items()),
        "GANTRY_HEARTBEAT_INTERVAL": str(settings.GANTRY_HEARTBEAT_INTERVAL),
        "GANTRY_GATEWAY_URL": gateway_url,
        "GANTRY_JOINED_HOST": "1",  # its Redis user reaches no channel-layer key (hosts.grants)
    }


def _used_token(secret: str, name: str) -> HostJoinToken:
    """The token's row, locked and marked used; refused by name when it cannot be used."""
    row = HostJoinToken.objects.select_for_update().filter(token_sha256=secret_digest(secret)).first()
    if row is None or not secret.startswith(TOKEN_PREFIX):
        raise PermissionDenied("token: not a join token of this control plane (gantry join-token makes one)")
    if row.used_at is not None:
        raise PermissionDenied(f"token: already used, by host {row.used_by_host} at {row.used_at:%Y-%m-%d %H:%M} UTC")
    if row.expires_at <= timezone.now():
        raise PermissionDenied(f"token: expired at {row.expires_at:%Y-%m-%d %H:%M} UTC; make a new one")
    if row.host_name and row.host_name != name:
        raise PermissionDenied(f"token: it is for host {row.host_name}, not {name}")
    HostJoinToken.objects.filter(pk=row.pk).update(used_at=timezone.now(), used_by_host=name)
    return row


def _revoke(credential: HostCredential) -> None:
    grants.database_role_drop(credential.database_role)
    grants.redis_user_remove(credential.redis_user)
    HostCredential.objects.filter(pk=credential.pk, revoked_at=None).update(revoked_at=timezone.now())


def host_join(*, token: str, name: str, address: str, gateway_url: str, certificate_request: str = "") -> Joined:
    """Trade a join token for the host's own credentials and register the host.

    A host that joined before gets new credentials, and its old ones stop
    working. The role and the token's use commit together; the Redis user is
    given before the commit, and the sync removes it should the commit fail.
    With ``certificate_request`` (PEM), the host's channel certificate is
    signed in the same step, and its earlier certificates are revoked.
    """
    name = _valid_host_name(name, "name")
    if address and (len(address) > 255 or any(c.isspace() for c in address)):
        raise ValidationFailed({"address": "must be a host name or an IP address, at most 255 characters"})
    if certificate_request:
        try:
            pki.load_request(certificate_request)
        except pki.BadRequest as exc:
            raise ValidationFailed({"certificate_request": str(exc)}) from None
    serial = secrets.token_hex(3)
    password, redis_password = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    with transaction.atomic():
        row = _used_token(token, name)
        host, created = GpuHost.objects.select_for_update().get_or_create(
            name=name, defaults={"address": address or "127.0.0.1"}
        )
        if address and host.address != address:
            GpuHost.objects.filter(pk=host.pk).update(address=address)
            host.address = address
        for old in HostCredential.objects.filter(host=host, revoked_at=None):
            _revoke(old)
        credential = HostCredential.objects.create(
            host=host,
            database_role=grants.host_role(name, serial),
            redis_user=grants.host_redis_user(name, serial),
            redis_password_sha256=secret_digest(redis_password),  # Redis takes a SHA-256 in hex (ACL SETUSER #...)
        )
        grants.database_role_create(credential.database_role, password)
        grants.redis_user_set(credential.redis_user, name, credential.redis_password_sha256)
        events.record(
            kind="host.joined",
            source=f"worker:{name}",
            actor=row.created_by,
            host=host,
            message=f"{name} joined with its own database role {credential.database_role} "
            f"and Redis user {credential.redis_user}" + ("" if created else " (its earlier ones are revoked)"),
        )
        issued = channel.host_certificate_issue(host, certificate_request) if certificate_request else None
    database_url = settings.GANTRY_JOIN_DATABASE_URL or _database_url()
    redis_url = settings.GANTRY_JOIN_REDIS_URL or settings.REDIS_URL
    return Joined(
        host=host,
        database_url=_with_credentials(database_url, credential.database_role, password),
        redis_url=_with_credentials(redis_url, credential.redis_user, redis_password),
        settings=_shared_settings(gateway_url),
        certificate=issued.certificate if issued else "",
        trust=channel.trust_pem(channel.authority()[0]) if issued else "",
    )


def _database_url() -> str:
    db = settings.DATABASES["default"]
    return f"postgres://{db.get('HOST') or '127.0.0.1'}:{db.get('PORT') or 5432}/{db['NAME']}"


def host_credentials_revoke(*, user: Any, host_name: str) -> int:
    """Revoke the host's credentials: its sessions end and it can no longer connect.
    Its row, deployments and timeline stay; ``gantry join`` with a new token brings it back."""
    _require_admin(user)
    with transaction.atomic():
        host = GpuHost.objects.select_for_update().filter(name=host_name).first()
        if host is None:
            raise NotFound(f"no host named {host_name}")
        active = list(HostCredential.objects.filter(host=host, revoked_at=None))
        for credential in active:
            _revoke(credential)
        certificates = channel.host_certificates_revoke(host)
        if active or certificates:
            events.record(
                kind="host.revoked",
                source=events.source_of(user),
                actor=user,
                host=host,
                message=f"{host_name}'s credentials and channel certificates are revoked: it can no longer reach "
                "the database or Redis, and the web tier no longer reaches its Triton servers",
            )
    return len(active) + certificates


def host_access_sync() -> int:
    """Converge PostgreSQL and Redis on the credentials the database holds: grants
    for tables new migrations made, the Redis users a restart lost, and no role or
    user that is revoked (or left by a join that did not commit). Returns the active count."""
    active = list(HostCredential.objects.filter(revoked_at=None).select_related("host"))
    if not active and not HostCredential.objects.exists():
        return 0  # no host ever joined: nothing to converge (and SQLite has no roles)
    grants.database_grants_ensure()
    roles = {c.database_role for c in active}
    for role in grants.database_roles_listed():
        if role not in roles:
            grants.database_role_drop(role)
    grants.redis_users_ensure({c.redis_user: (c.host.name, c.redis_password_sha256) for c in active})
    return len(active)
