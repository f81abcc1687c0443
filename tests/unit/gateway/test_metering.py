"""Gateway rate limits against a real Redis: tokens reserved at admission and
settled at the end hold a limit under concurrency, refusals are counted apart,
and Redis going away follows the operator's setting, said once in the log."""

from __future__ import annotations

import asyncio
import logging
import random
import uuid

import pytest
import redis
from django.conf import settings

from common.redis_async import forget_clients
from gateway import metering
from gateway.access import Caller
from gateway.errors import GatewayError


def _caller(**limits: int) -> Caller:
    return Caller(key_id=random.randrange(10**9), all_aliases=True, aliases=frozenset(), expires_at=None,
                  requests_per_minute=limits.get("requests"), tokens_per_minute=limits.get("tokens"))  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh_clients():
    forget_clients()  # one event loop per test
    metering.usage.counts.clear()
    yield
    forget_clients()


def _window_used(caller: Caller) -> int:
    window, _ = metering._window()
    value = redis.Redis.from_url(settings.REDIS_URL).hget(f"gantry:gateway:rate:{caller.key_id}:{window}", "tokens")
    return int(value or 0)


def test_twenty_concurrent_requests_never_pass_the_token_limit_by_more_than_one_reservation():
    caller, limit = _caller(tokens=1000), 1000
    served: list[int] = []
    refused: list[GatewayError] = []

    async def request(i: int) -> None:
        prompt = "x" * random.randrange(20, 120)
        reserve = metering.prompt_bound(prompt) + 100  # max_tokens 100
        try:
            admission = await metering.admit(caller, "chat", reserve=reserve)
        except GatewayError as exc:
            refused.append(exc)
            return
        await asyncio.sleep(random.random() / 50)  # generating, beside the others
        used = len(prompt) // 4 + random.randrange(1, 101)  # what the model really took
        served.append(used)
        await metering.settle(caller, admission, used)

    async def burst() -> None:
        await asyncio.gather(*(request(i) for i in range(20)))

    asyncio.run(burst())
    largest_reservation = 120 + 100
    assert served and refused  # some fit, the rest did not
    assert sum(served) <= limit + largest_reservation
    assert _window_used(caller) == sum(served)  # reservations settled to what was used
    assert all(e.status == 429 and e.body()["error"]["type"] == "tokens" for e in refused)
    assert "left this minute" in refused[0].body()["error"]["message"]
    # Refusals are counted apart: no request counted for them.
    tally = metering.usage.counts[(caller.key_id, "chat", next(iter(metering.usage.counts))[2])]
    assert tally.refused == len(refused) and tally.requests == 0


def test_one_request_larger_than_the_whole_limit_is_admitted_only_into_an_empty_minute():
    caller = _caller(tokens=50)

    async def run() -> None:
        admission = await metering.admit(caller, "chat", reserve=400)  # alone in its minute
        with pytest.raises(GatewayError):
            await metering.admit(caller, "chat", reserve=1)
        await metering.settle(caller, admission, 30)

    asyncio.run(run())


def test_an_embeddings_call_counts_one_request_per_input():
    caller = _caller(requests=10)

    async def run() -> None:
        await metering.admit(caller, "embed", requests=8)
        with pytest.raises(GatewayError) as refused:
            await metering.admit(caller, "embed", requests=3)
        assert "this call counts 3, one per input" in refused.value.body()["error"]["message"]
        await metering.admit(caller, "embed", requests=2)

    asyncio.run(run())


@pytest.mark.parametrize("policy", ["open", "closed"])
def test_without_redis_the_operators_setting_decides_and_the_log_says_it_once(settings, caplog, policy):
    settings.REDIS_URL = f"redis://127.0.0.1:1/{uuid.uuid4().int % 16}"  # nothing listens there
    settings.GANTRY_GATEWAY_LIMITS_WITHOUT_REDIS = policy
    metering.redis_state.away = False
    caller = _caller(requests=5)

    async def run() -> list[int]:
        codes = []
        for _ in range(3):
            try:
                await metering.admit(caller, "chat")
                codes.append(200)
            except GatewayError as exc:
                codes.append(exc.status)
        return codes

    with caplog.at_level(logging.ERROR, logger="gateway.metering"):
        codes = asyncio.run(run())
    assert codes == ([200] * 3 if policy == "open" else [503] * 3)
    said = [r for r in caplog.records if "Redis unreachable" in r.getMessage()]
    assert len(said) == 1 and ("without limits" if policy == "open" else "refusing") in said[0].getMessage()
    metering.redis_state.away = False
