"""Limits on how fast one client may call: the REST API and the lean generate
door per token or user (one counter), unauthenticated calls per address, and
failed sign-ins per account and per address (a lockout).

The API's rate counters live in Redis, so every web process counts together;
they fail open: while Redis is unreachable nothing is
limited, since refusing everyone would turn a cache outage into a full one.
Sign-in failures are few and matter more: they are counted in the database,
so a lockout holds through a Redis outage or restart."""

from __future__ import annotations

import logging
import math
from datetime import timedelta
from typing import Any

import redis
from django.conf import settings
from django.core.cache import caches
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from redis.exceptions import RedisError
from rest_framework.request import Request
from rest_framework.throttling import AnonRateThrottle, BaseThrottle

from access.models import SignInFailures
from access.services import bearer_secret
from common.redis_async import Reach, fixed_window, loop_client
from core.secrets import secret_digest

log = logging.getLogger(__name__)


def _shared() -> Any:
    return caches["shared"]


class PerAddress(AnonRateThrottle):
    """Unauthenticated calls, per address (GANTRY_API_THROTTLE_ANON), in DRF's
    own counter; open while the cache is unreachable."""

    def get_rate(self) -> str | None:
        # Read when a throttle is made, not when DRF was imported: settings may change.
        rate = settings.GANTRY_API_THROTTLE_ANON
        return None if rate == "off" else rate

    def allow_request(self, request: Request, view: Any) -> bool:
        self.cache = _shared()
        try:
            return super().allow_request(request, view)
        except Exception:  # noqa: BLE001 - any cache failure: let the request through
            log.warning("throttle counters unreachable; not limiting", exc_info=True)
            return True


def throttle_identity(*, token: str | None, user_pk: Any) -> str:
    """Whom a request is counted as: its API token (by digest, never the secret)
    when it carries one, else its signed-in user. The REST API and the lean
    generate door count the same identity in the same window."""
    return f"token:{secret_digest(token)[:24]}" if token is not None else f"user:{user_pk}"


def _window() -> tuple[int, int, int, int] | None:
    """GANTRY_API_THROTTLE as (allowed, period, window start), with the seconds
    left in the window; None when it is off. DRF's rate format: "100/minute"."""
    rate = settings.GANTRY_API_THROTTLE
    if rate == "off":
        return None
    count_text, unit = rate.split("/")
    period = {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit[0]]
    start, left = fixed_window(period)
    return int(count_text), period, start, left


def _counter(who: str, start: int) -> str:
    return f"gantry:throttle:{who}:{start}"


_reach = Reach(
    log,
    lambda exc: f"throttle counters unreachable ({exc}); not limiting the API until Redis is back",
    "throttle counters reachable again; the API is limited again",
    logging.WARNING,
)
_sync_clients: dict[str, redis.Redis] = {}


def throttled(who: str) -> int:
    """Count a request of ``who``: seconds to wait when over GANTRY_API_THROTTLE,
    else 0. One fixed window per identity in Redis, shared by every process and
    by both doors (PerUser, door_throttled); open while Redis is unreachable,
    since refusing everyone would turn a cache outage into a full one."""
    window = _window()
    if window is None:
        return 0
    allowed, period, start, left = window
    name = _counter(who, start)
    client = _sync_clients.get(settings.REDIS_URL)
    if client is None:
        client = _sync_clients[settings.REDIS_URL] = redis.Redis.from_url(
            settings.REDIS_URL, socket_timeout=0.5, socket_connect_timeout=0.5
        )
    try:
        with client.pipeline(transaction=False) as pipe:
            count, _ = pipe.incr(name).expire(name, period + 1).execute()
    except (RedisError, OSError) as exc:
        _reach.lost(exc, "the API's throttle")
        return 0
    _reach.reached()
    return 0 if count <= allowed else left


async def door_throttled(who: str) -> int:
    """``throttled`` on the event loop, for a door that takes the lean path before
    DRF (the generate action): the same counter, the same window."""
    window = _window()
    if window is None:
        return 0
    allowed, period, start, left = window
    name = _counter(who, start)
    try:
        async with loop_client().pipeline(transaction=False) as pipe:
            pipe.incr(name)
            pipe.expire(name, period + 1)
            count, _ = await pipe.execute()
    except (RedisError, OSError) as exc:
        _reach.lost(exc, "the API's throttle")
        return 0
    _reach.reached()
    return 0 if count <= allowed else left


class PerUser(BaseThrottle):
    """Signed-in calls to the REST API, in the one counter (``throttled``):
    per token when the call carries one, else per user."""

    def allow_request(self, request: Request, view: Any) -> bool:
        if not request.user or not request.user.is_authenticated:
            return True  # PerAddress counts those
        token = bearer_secret(request.headers.get("Authorization", ""))
        self.wait_s = throttled(throttle_identity(token=token, user_pk=request.user.pk))
        return self.wait_s == 0

    def wait(self) -> float | None:
        return self.wait_s


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
