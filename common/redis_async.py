"""One asyncio Redis client per event loop (a client is bound to the loop it
was made on), for the request paths that count in Redis: the gateway's rate
limits and the doors' per-user throttle. Short timeouts: a request never waits
long on a Redis that has gone away. Both count in fixed windows
(``fixed_window``) and say once when Redis goes away and when it is back
(``Reach``)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from django.conf import settings

_clients: dict[tuple[asyncio.AbstractEventLoop, str], aioredis.Redis] = {}


def loop_client() -> aioredis.Redis:
    """This event loop's client of settings.REDIS_URL."""
    key = (asyncio.get_running_loop(), settings.REDIS_URL)
    client = _clients.get(key)
    if client is None:
        client = _clients[key] = aioredis.from_url(settings.REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    return client


_scripts: dict[tuple[aioredis.Redis, str], Any] = {}


def loop_script(source: str) -> Any:
    """A Lua script on this loop's client, registered once (EVALSHA, loaded on first use)."""
    client = loop_client()
    script = _scripts.get((client, source))
    if script is None:
        script = _scripts[(client, source)] = client.register_script(source)
    return script


def fixed_window(period_s: int) -> tuple[int, int]:
    """The current window of ``period_s`` seconds: its start (epoch seconds) and
    the whole seconds left in it (at least 1, a Retry-After)."""
    now = time.time()
    start = int(now // period_s) * period_s
    return start, max(1, math.ceil(start + period_s - now))


class Reach:
    """Whether one user of Redis reached it on its last call: losing it is logged
    once (``lost_message(exc)`` at ``level``) and so is its return, not once
    per request."""

    def __init__(
        self, logger: logging.Logger, lost_message: Callable[[Exception], str], back_message: str, level: int
    ) -> None:
        self.log, self.lost_message, self.back_message, self.level = logger, lost_message, back_message, level
        self.away = False

    def lost(self, exc: Exception, what: str = "") -> None:
        if not self.away:
            self.away = True
            self.log.log(self.level, self.lost_message(exc))
        self.log.debug("%s without Redis: %s", what or "a call", exc)

    def reached(self) -> None:
        if self.away:
            self.away = False
            self.log.warning(self.back_message)


def forget_clients() -> None:
    """Drop every client (tests that change REDIS_URL or run a loop each)."""
    _clients.clear()
    _scripts.clear()
