"""Limits on how fast one client may call: the REST API per user or address
(DRF throttles), and failed sign-ins per username and address (a lockout).

Counters live in the shared Redis cache, so every web process counts
together. They fail open: while Redis is unreachable nothing is limited,
since refusing everyone would turn a cache outage into a full one."""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.core.cache import caches
from rest_framework.request import Request
from rest_framework.throttling import AnonRateThrottle, UserRateThrottle

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
    return f"login-failures:{address}:{username.strip().lower()[:150]}"


def login_locked(username: str, address: str) -> bool:
    """Whether sign-ins for ``username`` from ``address`` are refused for now."""
    try:
        return (_shared().get(_login_key(username, address)) or 0) >= settings.GANTRY_LOGIN_ATTEMPTS
    except Exception:  # noqa: BLE001
        log.warning("sign-in failure counters unreachable", exc_info=True)
        return False


def login_failed(username: str, address: str) -> None:
    key = _login_key(username, address)
    try:
        cache = _shared()
        cache.add(key, 0, timeout=settings.GANTRY_LOGIN_LOCKOUT_S)
        cache.incr(key)
    except Exception:  # noqa: BLE001
        log.warning("sign-in failure counters unreachable", exc_info=True)


def login_succeeded(username: str, address: str) -> None:
    try:
        _shared().delete(_login_key(username, address))
    except Exception:  # noqa: BLE001
        log.warning("sign-in failure counters unreachable", exc_info=True)
