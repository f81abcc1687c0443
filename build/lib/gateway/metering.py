"""Rate limits and usage of gateway keys.

Limits are per key and per minute (fixed windows in Redis, shared by every
web process): a request is admitted while the key's requests in this minute
stay within ``requests_per_minute`` and its tokens so far stay below
``tokens_per_minute``; a request's tokens are charged when it ends (a
generation's length is not known before). Keys without limits never touch
Redis. If Redis cannot be reached the gateway serves without limits and logs
it, rather than refusing every request.

Usage is counted in memory and added to the database every FLUSH_S by one
task per process (usage of the last second is lost if the process is killed).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections import defaultdict

import redis.asyncio as aioredis
from django.conf import settings
from django.utils import timezone

from gateway.access import Caller, db
from gateway.errors import GatewayError
from gateway.services import Tally, usage_add

log = logging.getLogger(__name__)

WINDOW_S = 60
FLUSH_S = 1.0

_clients: dict[asyncio.AbstractEventLoop, aioredis.Redis] = {}


def _redis() -> aioredis.Redis:
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        client = _clients[loop] = aioredis.from_url(settings.REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    return client


def _window() -> tuple[str, int]:
    now = time.time()
    start = int(now // WINDOW_S) * WINDOW_S
    return str(start), max(1, int(start + WINDOW_S - now + 0.999))


async def admit(caller: Caller) -> None:
    """Count a request against the key's limits, or refuse it with a 429."""
    if caller.requests_per_minute is None and caller.tokens_per_minute is None:
        return
    window, retry_after = _window()
    name = f"gantry:gateway:rate:{caller.key_id}:{window}"
    try:
        async with _redis().pipeline(transaction=False) as pipe:
            pipe.hincrby(name, "requests", 1)
            pipe.hget(name, "tokens")
            pipe.expire(name, WINDOW_S * 2)
            requests, tokens, _ = await pipe.execute()
    except (aioredis.RedisError, OSError) as exc:
        log.warning("gateway rate limits not applied: Redis unreachable (%s)", exc)
        return
    if caller.requests_per_minute is not None and requests > caller.requests_per_minute:
        raise GatewayError(
            429,
            f"Rate limit reached: {caller.requests_per_minute} requests per minute for this key. "
            f"Try again in {retry_after} s.",
            type="requests",
            code="rate_limit_exceeded",
            retry_after=retry_after,
        )
    if caller.tokens_per_minute is not None and int(tokens or 0) >= caller.tokens_per_minute:
        raise GatewayError(
            429,
            f"Rate limit reached: {caller.tokens_per_minute} tokens per minute for this key. "
            f"Try again in {retry_after} s.",
            type="tokens",
            code="rate_limit_exceeded",
            retry_after=retry_after,
        )


async def charge(caller: Caller, tokens: int) -> None:
    """Charge a finished request's tokens to the key's current minute."""
    if caller.tokens_per_minute is None or tokens <= 0:
        return
    window, _ = _window()
    name = f"gantry:gateway:rate:{caller.key_id}:{window}"
    try:
        async with _redis().pipeline(transaction=False) as pipe:
            pipe.hincrby(name, "tokens", tokens)
            pipe.expire(name, WINDOW_S * 2)
            await pipe.execute()
    except (aioredis.RedisError, OSError) as exc:
        log.warning("gateway token charge lost: Redis unreachable (%s)", exc)


class _Usage:
    def __init__(self) -> None:
        self.counts: dict[tuple[int, str, dt.date], Tally] = defaultdict(Tally)
        self.last_used: dict[int, dt.datetime] = {}
        self.flusher: asyncio.Task | None = None

    def count(self, key_id: int, alias: str, *, prompt: int, completion: int, failed: bool) -> None:
        now = timezone.now()
        tally = self.counts[(key_id, alias, now.date())]
        tally.requests += 1
        tally.failed += int(failed)
        tally.prompt_tokens += prompt
        tally.completion_tokens += completion
        self.last_used[key_id] = now
        if self.flusher is None or self.flusher.done():
            self.flusher = asyncio.get_running_loop().create_task(self._flush_soon())

    async def _flush_soon(self) -> None:
        await asyncio.sleep(FLUSH_S)
        await self.flush()

    async def flush(self) -> None:
        counts, last_used = self.counts, self.last_used
        if not counts:
            return
        self.counts, self.last_used = defaultdict(Tally), {}
        try:
            await db(usage_add)(counts=dict(counts), last_used=last_used)
        except Exception:  # the database is away: keep the counts for the next flush
            log.exception("gateway usage not saved yet")
            for key, tally in counts.items():
                mine = self.counts[key]
                for field in ("requests", "failed", "prompt_tokens", "completion_tokens"):
                    setattr(mine, field, getattr(mine, field) + getattr(tally, field))
            self.last_used = {**last_used, **self.last_used}


usage = _Usage()
