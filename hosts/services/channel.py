"""The channel's authority, on the control plane: Gantry's own certificate
authority, the certificates it signs for GPU hosts and for the web tier, and
revocation.

- The authority is made the first time it is needed. Its key and the web
  tier's are in ChannelSecrets, a table hosts' database roles cannot read.
- A host gets its first certificate when it joins (``gantry join`` sends a
  certificate request with the token), or, for a host started with
  credentials in hand (the demo, a compose file), from the request its agent
  leaves on its row, if it never had one. Renewals come the same way, signed
  with the host's current key; the sweep signs them (``channel_requests_sign``).
- Revoking a host (``POST /api/hosts/<name>/revoke/``) revokes its
  certificates and signs a new revocation list: the web tier refuses the
  host's server from then on, and nothing is signed for it until it joins again.
- The web tier's client certificate is made and renewed on demand
  (``client_context``), read back by every web process.

Why a channel of Gantry's own rather than Triton's gRPC with TLS:
docs/security.md says.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from common import pki
from core import events
from hosts.models import ChannelAuthority, ChannelCertificate, ChannelSecrets, GpuHost

log = logging.getLogger(__name__)
CLIENT_NAME = "gantry web tier"
# How long a web process keeps its client context before it reads the revocation list again.
CONTEXT_TTL_S = 2.0


def _lifetime() -> timedelta:
    return timedelta(hours=settings.GANTRY_CHANNEL_CERT_HOURS)


def authority() -> tuple[ChannelAuthority, ChannelSecrets]:
    """The authority and its secrets, made on first use (once, whoever races)."""
    found = ChannelAuthority.objects.filter(pk=1).first()
    if found is not None:
        return found, ChannelSecrets.objects.get(pk=1)
    now = timezone.now()
    key, certificate = pki.new_authority(now)
    crl = pki.revocation_list(authority_key=key, authority=certificate, serials=[], number=1, now=now)
    try:
        with transaction.atomic():
            ChannelSecrets.objects.create(pk=1, authority_key=pki.key_pem(key))
            ChannelAuthority.objects.create(
                pk=1, certificate=pki.cert_pem(certificate), revocation_list=pki.cert_pem(crl), revocation_signed_at=now
            )
    except IntegrityError:
        pass  # another process made it first: use theirs
    return ChannelAuthority.objects.get(pk=1), ChannelSecrets.objects.get(pk=1)


def trust_pem(row: ChannelAuthority) -> str:
    """What a peer is checked against: the authority's certificate and its revocation list."""
    return row.certificate + row.revocation_list


def _sign(public: Any, *, common: str, host: GpuHost | None) -> ChannelCertificate:
    row, secrets = authority()
    now = timezone.now()
    made = pki.issue(
        authority_key=pki.load_key(secrets.authority_key),
        authority=pki.load_cert(row.certificate),
        public=public,
        common=common,
        now=now,
        lifetime=_lifetime(),
        host_id=host.pk if host is not None else None,
    )
    return ChannelCertificate.objects.create(
        host=host, serial=f"{made.serial_number:x}", certificate=pki.cert_pem(made), not_after=pki.not_after(made)
    )


def host_certificate_issue(host: GpuHost, request_pem: str) -> ChannelCertificate:
    """A certificate for ``host``'s key (its request, PEM): at join, its earlier
    certificates are revoked (a host that joins again may have lost its key)."""
    request = pki.load_request(request_pem)
    with transaction.atomic():
        earlier = list(ChannelCertificate.objects.filter(host=host, revoked_at=None).values_list("serial", flat=True))
        if earlier:
            _revoke_serials(earlier)
        GpuHost.objects.filter(pk=host.pk).update(channel_revoked=False, channel_request="", channel_proof="")
        issued = _sign(request, common=host.name, host=host)
    _said(host, issued, "joined")
    return issued


def _said(host: GpuHost, issued: ChannelCertificate, why: str) -> None:
    events.record(
        kind="host.certificate",
        source="system",
        host=host,
        message=f"{host.name}'s channel certificate {issued.serial[:12]} is signed ({why}), "
        f"valid until {issued.not_after:%Y-%m-%d %H:%M} UTC",
    )


def current(host: GpuHost) -> ChannelCertificate | None:
    """The host's newest certificate that is neither revoked nor expired."""
    return (
        ChannelCertificate.objects.filter(host=host, revoked_at=None, not_after__gt=timezone.now())
        .order_by("-created_at", "-pk")
        .first()
    )


def channel_requests_sign() -> int:
    """Sign what hosts' agents asked for (the sweep): a renewal proven with the
    host's current key, or the first certificate of a host that never had one.
    Anything else is refused on the host's timeline, and the request cleared."""
    signed = 0
    for host in GpuHost.objects.exclude(channel_request=""):
        with transaction.atomic():
            row = GpuHost.objects.select_for_update().get(pk=host.pk)
            if not row.channel_request:
                continue
            request_pem, proof = row.channel_request, row.channel_proof
            GpuHost.objects.filter(pk=row.pk).update(channel_request="", channel_proof="")
            refusal, why = _refusal(row, request_pem, proof)
            if refusal:
                events.record(kind="host.certificate_refused", source="system", host=row, message=refusal)
                continue
            issued = _sign(pki.load_request(request_pem), common=row.name, host=row)
        _said(row, issued, why)
        signed += 1
    return signed


def _refusal(host: GpuHost, request_pem: str, proof: str) -> tuple[str, str]:
    """Why ``host``'s request is refused ("" to sign it), and why it is signed."""
    if host.channel_revoked:
        return f"{host.name}'s certificates are revoked: it gets a new one when it joins again (gantry join)", ""
    try:
        pki.load_request(request_pem)
    except pki.BadRequest as exc:
        return f"{host.name}'s certificate request is refused: {exc}", ""
    now_valid = current(host)
    if now_valid is not None:
        if proof and pki.proven(pki.load_cert(now_valid.certificate), request_pem, proof):
            return "", "a renewal"
        return f"{host.name}'s renewal is refused: it is not signed with the key of its current certificate", ""
    if ChannelCertificate.objects.filter(host=host).exists():
        return f"{host.name}'s certificate expired: it gets a new one when it joins again (gantry join)", ""
    return "", "its first"


def host_certificates_revoke(host: GpuHost) -> int:
    """Revoke every certificate of ``host`` (inside the caller's transaction) and
    keep it from getting another until it joins again."""
    serials = list(ChannelCertificate.objects.filter(host=host, revoked_at=None).values_list("serial", flat=True))
    GpuHost.objects.filter(pk=host.pk).update(
        channel_revoked=True, channel_request="", channel_proof="", channel_port=0
    )
    if serials:
        _revoke_serials(serials)
    return len(serials)


def _revoke_serials(serials: list[str]) -> None:
    ChannelCertificate.objects.filter(serial__in=serials).update(revoked_at=timezone.now())
    _sign_revocation_list()


def _sign_revocation_list() -> None:
    """A new revocation list: every revoked certificate that has not expired yet."""
    authority()
    row = ChannelAuthority.objects.select_for_update().get(pk=1)
    secrets = ChannelSecrets.objects.get(pk=1)
    now = timezone.now()
    serials = ChannelCertificate.objects.filter(revoked_at__isnull=False, not_after__gt=now).values_list(
        "serial", flat=True
    )
    crl = pki.revocation_list(
        authority_key=pki.load_key(secrets.authority_key),
        authority=pki.load_cert(row.certificate),
        serials=[int(serial, 16) for serial in serials],
        number=row.revocation_number + 1,
        now=now,
    )
    ChannelAuthority.objects.filter(pk=1).update(
        revocation_list=pki.cert_pem(crl), revocation_number=row.revocation_number + 1, revocation_signed_at=now
    )


def revocation_list_refresh() -> bool:
    """Sign the revocation list again when half of its validity is gone (the sweep)."""
    row = ChannelAuthority.objects.filter(pk=1).first()
    if row is None or timezone.now() - row.revocation_signed_at < timedelta(days=pki.CRL_DAYS / 2):
        return False
    with transaction.atomic():
        _sign_revocation_list()
    return True


# --- the web tier's side -----------------------------------------------------------


def client_certificate() -> tuple[ChannelAuthority, str, str]:
    """The authority (its trust), and the web tier's key and certificate (PEM),
    made or renewed when due (under a lock, so one web process does it)."""
    row, secrets = authority()
    usable = _client_certificate_usable(secrets)
    if usable is not None:
        return row, *usable
    with transaction.atomic():
        secrets = ChannelSecrets.objects.select_for_update().get(pk=1)
        usable = _client_certificate_usable(secrets)  # another process may have renewed it meanwhile
        if usable is not None:
            return row, *usable
        key = pki.new_key()
        request = pki.load_request(pki.request(key, CLIENT_NAME))
        issued = _sign(request, common=CLIENT_NAME, host=None)
        ChannelSecrets.objects.filter(pk=1).update(client_key=pki.key_pem(key))
        return row, pki.key_pem(key), issued.certificate


def _client_certificate_usable(secrets: ChannelSecrets) -> tuple[str, str] | None:
    """The web tier's key and newest certificate, unless missing, mismatched or due for renewal."""
    latest = ChannelCertificate.objects.filter(host=None, revoked_at=None).order_by("-created_at", "-pk").first()
    if not secrets.client_key or latest is None:
        return None
    certificate = pki.load_cert(latest.certificate)
    if pki.renewal_due(certificate, timezone.now()):
        return None
    if pki.public_bytes(certificate) != pki.public_bytes(pki.load_key(secrets.client_key)):
        return None
    return secrets.client_key, latest.certificate


class _ClientContext:
    """The web process's TLS context for hosts' channels, read again every
    CONTEXT_TTL_S and made anew when the revocation list or its certificate
    changed (a new context also means new connections: triton_server.http1 pools by it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[int, str] | None = None
        self._context: ssl.SSLContext | None = None
        self._read_at = 0.0

    def get(self) -> ssl.SSLContext:
        with self._lock:
            if self._context is not None and time.monotonic() - self._read_at < CONTEXT_TTL_S:
                return self._context
            row, key_pem, certificate = client_certificate()
            identity = (row.revocation_number, certificate)
            if identity != self._key or self._context is None:
                self._context = pki.context(server=False, key=key_pem, certificate=certificate, trust=trust_pem(row))
                self._key = identity
            self._read_at = time.monotonic()
            return self._context


_client = _ClientContext()


def client_context() -> ssl.SSLContext:
    """The web tier's TLS context for hosts' channels (call from a thread, not the event loop)."""
    return _client.get()
