"""Limits on how fast one client may call: the REST API per user or address
(DRF throttles), and failed sign-ins per username and address (a lockout).

The API's rate counters live in the shared Redis cache, so every web process
counts together; they fail open: while Redis is unreachable nothing is
limited, since refusing everyone would turn a cache outage into a full one.
Sign-in failures are few and matter more: they are counted in the database,
so a lockout holds through a Redis outage or restart."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.cache import caches
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from rest_framework.request import Request
from rest_framework.throttling import AnonRateThrottle, UserRateThrottle

from access.models import SignInFailures

log = logging.getLogger(__name__)


def _shared() -> Any:
    return caches["shared"]


class _FailOpen:
    setting = ""

    def get_rate(self) -> str | None:
        # Read when a throttle is made, not when DRF was imported: settings may change.
        rate = getattr(settings, self.setting)
        return None if rate == "off" else rate

    def allow_request(self, request: Request, view: Any) -> bool:
        self.cache = _shared()
        try:
            return super().allow_request(request, view)
        except Exception:  # noqa: BLE001 - any cache failure: let the request through
            log.warning("throttle counters unreachable; not limiting", exc_info=True)
            return True


class PerUser(_FailOpen, UserRateThrottle):
    setting = "GANTRY_API_THROTTLE"


class PerAddress(_FailOpen, AnonRateThrottle):
    setting = "GANTRY_API_THROTTLE_ANON"


def _login_key(username: str, address: str) -> str:
    return f"{address}:{username.strip().lower()[:150]}"[:255]


def login_locked(username: str, address: str) -> bool:
    """Whether sign-ins for ``username`` from ``address`` are refused for now."""
    return SignInFailures.objects.filter(
        key=_login_key(username, address),
        expires_at__gt=timezone.now(),
        failures__gte=settings.GANTRY_LOGIN_ATTEMPTS,
    ).exists()


def login_failed(username: str, address: str) -> None:
    """Count a failure; the count ends GANTRY_LOGIN_LOCKOUT_S after its first."""
    key, now = _login_key(username, address), timezone.now()
    with transaction.atomic():
        row, created = SignInFailures.objects.select_for_update().get_or_create(
            key=key, defaults={"failures": 1, "expires_at": now + timedelta(seconds=settings.GANTRY_LOGIN_LOCKOUT_S)}
        )
        if created:
            return
        if row.expires_at <= now:
            row.failures, row.expires_at = 1, now + timedelta(seconds=settings.GANTRY_LOGIN_LOCKOUT_S)
            row.save(update_fields=["failures", "expires_at"])
        else:
            SignInFailures.objects.filter(pk=row.pk).update(failures=F("failures") + 1)
    SignInFailures.objects.filter(expires_at__lte=now).delete()  # what has run out, anyone's


def login_succeeded(username: str, address: str) -> None:
    SignInFailures.objects.filter(key=_login_key(username, address)).delete()
