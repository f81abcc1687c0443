"""Rate limits and usage of gateway keys.

Limits are per key and per minute (fixed windows in Redis, shared by every
web process). Admission is one atomic step (a Lua script): a request is
admitted while the key's requests in this minute stay within
``requests_per_minute`` and its reserved tokens fit in what is left of
``tokens_per_minute``, and only then counted. A request reserves the most
tokens it can take: its prompt's UTF-8 bytes (no tokenizer makes more tokens
than bytes, special tokens included, as chat templates write them as text)
plus ``max_tokens``. When it ends, the reservation is settled to what it
used. So concurrent requests cannot pass the limit together; the one
exception is a single request larger than the whole limit, admitted only
into an empty minute (a limit is never a permanent refusal). An embeddings
call counts one request per input.

Refusals are counted apart (``refused``), not as requests. Keys without limits
never touch Redis. If Redis cannot be reached, GANTRY_GATEWAY_LIMITS_WITHOUT_REDIS
decides: ``open`` serves without limits, ``closed`` refuses with 503; the log
says so once when Redis goes and once when it is back.

Usage is counted in memory and added to the database every FLUSH_S by one
task per process (usage of the last second is lost if the process is killed).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections import defaultdict
from dataclasses import dataclass

import redis.asyncio as aioredis
from django.conf import settings
from django.utils import timezone

from common.redis_async import Reach, fixed_window, loop_client, loop_script
from gateway.access import Caller, db
from gateway.errors import GatewayError
from gateway.services import Tally, usage_add

log = logging.getLogger(__name__)

WINDOW_S = 60
FLUSH_S = 1.0

# KEYS[1]: the key's window. ARGV: request limit, token limit (-1: none), the
# requests this call counts, the tokens it reserves, the window's lifetime.
# Returns 0 (admitted), 1 (requests) or 2 (tokens), and what the window held.
_ADMIT = """
local requests = tonumber(redis.call('HGET', KEYS[1], 'requests') or '0')
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens') or '0')
local request_limit, token_limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local count, reserve = tonumber(ARGV[3]), tonumber(ARGV[4])
local refused = 0
if request_limit >= 0 and requests + count > request_limit then
  refused = 1
elseif token_limit >= 0 and tokens > 0 and tokens + reserve > token_limit then
  refused = 2
end
if refused == 0 then
  redis.call('HINCRBY', KEYS[1], 'requests', count)
  redis.call('HINCRBY', KEYS[1], 'tokens', reserve)
else
  redis.call('HINCRBY', KEYS[1], 'refused', 1)
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5]))
return {refused, requests, tokens}
"""


def _window() -> tuple[str, int]:
    start, left = fixed_window(WINDOW_S)
    return str(start), left


def _lost(exc: Exception) -> str:
    policy = settings.GANTRY_GATEWAY_LIMITS_WITHOUT_REDIS
    doing = "serving without limits" if policy == "open" else "refusing keys with limits"
    return (
        f"gateway rate limits: Redis unreachable ({exc}); {doing} until it is back "
        f"(GANTRY_GATEWAY_LIMITS_WITHOUT_REDIS={policy})"
    )


redis_state = Reach(log, _lost, "gateway rate limits: Redis is back; limits apply again", logging.ERROR)


@dataclass(frozen=True)
class Admission:
    """What admission counted: the window and the tokens reserved there ("" and 0: nothing)."""

    window: str = ""
    reserved: int = 0


UNCOUNTED = Admission()


def prompt_bound(*texts: str) -> int:
    """The most tokens ``texts`` can take: their UTF-8 bytes (no tokenizer makes more)."""
    return sum(len(text.encode("utf-8")) for text in texts)


async def admit(caller: Caller, alias: str, *, requests: int = 1, reserve: int = 0) -> Admission:
    """Count ``requests`` and reserve ``reserve`` tokens against the key's
    limits, or refuse with a 429 (counted as a refusal)."""
    if caller.requests_per_minute is None and caller.tokens_per_minute is None:
        return UNCOUNTED
    window, retry_after = _window()
    reserve = reserve if caller.tokens_per_minute is not None else 0
    limits = [-1 if limit is None else limit for limit in (caller.requests_per_minute, caller.tokens_per_minute)]
    try:
        refused, _used, tokens = await loop_script(_ADMIT)(
            keys=[f"gantry:gateway:rate:{caller.key_id}:{window}"], args=[*limits, requests, reserve, WINDOW_S * 2]
        )
    except (aioredis.RedisError, OSError) as exc:
        redis_state.lost(exc, "admission")
        if settings.GANTRY_GATEWAY_LIMITS_WITHOUT_REDIS == "closed":
            raise GatewayError(
                503, "This key's rate limits cannot be checked now (the gateway's Redis is unreachable); try again "
                "shortly.", type="server_error", code="limits_unavailable", retry_after=5,
            ) from exc  # fmt: skip
        return UNCOUNTED
    redis_state.reached()
    if refused:
        usage.count(caller.key_id, alias, requests=0, refused=1)
    if refused == 1:
        raise GatewayError(
            429,
            f"Rate limit reached: {caller.requests_per_minute} requests per minute for this key"
            + (f" (this call counts {requests}, one per input)" if requests > 1 else "")
            + f". Try again in {retry_after} s.",
            type="requests",
            code="rate_limit_exceeded",
            retry_after=retry_after,
        )
    if refused == 2:
        left = max(0, caller.tokens_per_minute - int(tokens))  # type: ignore[operator]
        raise GatewayError(
            429,
            f"Rate limit reached: {caller.tokens_per_minute} tokens per minute for this key. This request reserves "
            f"{reserve} (its prompt's bytes and max_tokens) and {left} are left this minute. Try again in "
            f"{retry_after} s, or ask for fewer max_tokens.",
            type="tokens",
            code="rate_limit_exceeded",
            retry_after=retry_after,
        )
    return Admission(window=window, reserved=reserve)


async def settle(caller: Caller, admission: Admission, used: int) -> None:
    """Turn an admitted request's reservation into the tokens it used."""
    if not admission.window or used == admission.reserved:
        return
    name = f"gantry:gateway:rate:{caller.key_id}:{admission.window}"
    try:
        async with loop_client().pipeline(transaction=False) as pipe:
            pipe.hincrby(name, "tokens", used - admission.reserved)
            pipe.expire(name, WINDOW_S * 2)
            await pipe.execute()
    except (aioredis.RedisError, OSError) as exc:
        redis_state.lost(exc, "settlement")


class _Usage:
    def __init__(self) -> None:
        self.counts: dict[tuple[int, str, dt.date], Tally] = defaultdict(Tally)
        self.last_used: dict[int, dt.datetime] = {}
        self.flusher: asyncio.Task | None = None

    def count(
        self, key_id: int, alias: str, *, requests: int = 1, prompt: int = 0, completion: int = 0, failed: bool = False,
        refused: int = 0,
    ) -> None:  # fmt: skip
        now = timezone.now()
        tally = self.counts[(key_id, alias, now.date())]
        tally.requests += requests
        tally.failed += int(failed)
        tally.refused += refused
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
                for field in ("requests", "failed", "refused", "prompt_tokens", "completion_tokens"):
                    setattr(mine, field, getattr(mine, field) + getattr(tally, field))
            self.last_used = {**last_used, **self.last_used}


usage = _Usage()
