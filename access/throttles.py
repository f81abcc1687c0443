"""Limits on how fast one client may call: the REST API per user or address
(DRF throttles), and failed sign-ins per account and per address (a lockout).

The API's rate counters live in the shared Redis cache, so every web process
counts together; they fail open: while Redis is unreachable nothing is
limited, since refusing everyone would turn a cache outage into a full one.
Sign-in failures are few and matter more: they are counted in the database,
so a lockout holds through a Redis outage or restart."""

from __future__ import annotations

import logging
import math
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.cache import caches
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from redis.exceptions import RedisError
from rest_framework.request import Request
from rest_framework.throttling import AnonRateThrottle, UserRateThrottle

from access.models import SignInFailures
from common.redis_async import Reach, fixed_window, loop_client

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


_door_reach = Reach(
    log,
    lambda exc: f"throttle counters unreachable ({exc}); not limiting the generate action until Redis is back",
    "throttle counters reachable again; the generate action is limited again",
    logging.WARNING,
)


async def door_throttled(who: str) -> int:
    """Count a request of ``who`` (a user or a token) at a door that takes the
    lean path before DRF (the generate action): seconds to wait when over
    GANTRY_API_THROTTLE, else 0. Fixed windows in Redis shared by every
    process; open while Redis is unreachable, as the API's throttles are
    (said once in the log)."""
    rate = settings.GANTRY_API_THROTTLE
    if rate == "off":
        return 0
    count_text, unit = rate.split("/")
    allowed, period = int(count_text), {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit[0]]  # DRF's rate format
    start, left = fixed_window(period)
    name = f"gantry:throttle:door:{who}:{start}"
    try:
        async with loop_client().pipeline(transaction=False) as pipe:
            pipe.incr(name)
            pipe.expire(name, period + 1)
            count, _ = await pipe.execute()
    except (RedisError, OSError) as exc:
        _door_reach.lost(exc, "the generate action's throttle")
        return 0
    _door_reach.reached()
    return 0 if count <= allowed else left


def _login_limits(username: str, address: str) -> dict[str, int]:
    """The counters a sign-in for ``username`` from ``address`` feeds, each with
    the failures that lock it: the account's (whatever the address: guessing
    one password) and the address's (whatever the account: a spray of one
    password over many)."""
    return {
        f"user:{username.strip().lower()[:150]}": settings.GANTRY_LOGIN_ATTEMPTS,
        f"addr:{address}"[:255]: settings.GANTRY_LOGIN_ADDRESS_ATTEMPTS,
    }


def login_locked_for(username: str, address: str) -> int:
    """Seconds sign-ins for ``username`` from ``address`` are refused for (0: not locked)."""
    limits, now = _login_limits(username, address), timezone.now()
    left = 0.0
    for key, failures, expires_at in SignInFailures.objects.filter(key__in=limits, expires_at__gt=now).values_list(
        "key", "failures", "expires_at"
    ):
        if failures >= limits[key]:
            left = max(left, (expires_at - now).total_seconds())
    return math.ceil(left)


def login_failed(username: str, address: str) -> None:
    """Count a failure on the account and on the address; each count ends
    GANTRY_LOGIN_LOCKOUT_S after its first failure."""
    now = timezone.now()
    ends = now + timedelta(seconds=settings.GANTRY_LOGIN_LOCKOUT_S)
    for key in _login_limits(username, address):
        with transaction.atomic():
            row, created = SignInFailures.objects.select_for_update().get_or_create(
                key=key, defaults={"failures": 1, "expires_at": ends}
            )
            if created:
                continue
            if row.expires_at <= now:
                row.failures, row.expires_at = 1, ends
                row.save(update_fields=["failures", "expires_at"])
            else:
                SignInFailures.objects.filter(pk=row.pk).update(failures=F("failures") + 1)
    SignInFailures.objects.filter(expires_at__lte=now).delete()  # what has run out, anyone's


def login_succeeded(username: str, address: str) -> None:
    """The account's count starts again; the address's runs on (one account an
    attacker holds must not reset a spray's count)."""
    account = next(iter(_login_limits(username, address)))
    SignInFailures.objects.filter(key=account).delete()
