"""One asyncio Redis client per event loop (a client is bound to the loop it
was made on), for the request paths that count in Redis: the gateway's rate
limits and the doors' per-user throttle. Short timeouts: a request never waits
long on a Redis that has gone away."""

from __future__ import annotations

import asyncio
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


def forget_clients() -> None:
    """Drop every client (tests that change REDIS_URL or run a loop each)."""
    _clients.clear()
    _scripts.clear()
