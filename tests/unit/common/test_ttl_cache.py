"""The per-process second-long cache the busiest doors read through."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.ttl_cache import MISSING, TtlCache


def test_a_value_is_kept_for_its_time_then_forgotten():
    cache = TtlCache(ttl_s=0.05)
    assert cache.put("k", None) is None
    assert cache.get("k", MISSING) is None  # a kept None is not a miss
    time.sleep(0.06)
    assert cache.get("k", MISSING) is MISSING


def test_a_flood_of_keys_starts_again_instead_of_growing():
    cache = TtlCache(ttl_s=60, max_entries=3)
    for i in range(7):
        cache.put(i, i)
    assert len(cache._entries) <= 3 and cache.get(6) == 6


def test_fetch_serves_a_stale_value_while_one_background_read_replaces_it():
    reads: list[int] = []

    async def read() -> int:
        reads.append(len(reads))
        await asyncio.sleep(0.01)
        return len(reads)

    async def scenario() -> None:
        cache = TtlCache(ttl_s=0.05)
        assert await cache.fetch("k", read) == 1  # the first request reads
        assert await cache.fetch("k", read) == 1 and len(reads) == 1  # fresh: kept
        await asyncio.sleep(0.06)
        # Stale: served at once, twice, while a single read refreshes it.
        assert [await cache.fetch("k", read), await cache.fetch("k", read)] == [1, 1]
        await asyncio.sleep(0.02)
        assert await cache.fetch("k", read) == 2 and len(reads) == 2
        await asyncio.sleep(0.11)  # past ttl twice over: too old to serve, read now
        assert await cache.fetch("k", read) == 3

    asyncio.run(scenario())


def test_a_failed_refresh_keeps_the_stale_value_only_until_it_is_too_old():
    answers = iter([1, RuntimeError("database down"), RuntimeError("database down")])

    async def read() -> int:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def scenario() -> None:
        cache = TtlCache(ttl_s=0.05)
        assert await cache.fetch("k", read) == 1
        await asyncio.sleep(0.06)
        assert await cache.fetch("k", read) == 1  # stale; its refresh fails in the background
        await asyncio.sleep(0.06)
        try:
            await cache.fetch("k", read)
        except RuntimeError as exc:
            assert str(exc) == "database down"
        else:
            raise AssertionError("a value past its grace was served")

    asyncio.run(scenario())


class Away(Exception):
    """What a read raises while the database cannot be reached."""


def test_while_reads_fail_with_an_outage_the_last_value_serves_until_it_is_too_old():
    state = {"away": False, "reads": 0}

    async def read() -> str:
        state["reads"] += 1
        if state["away"]:
            raise Away("connection refused")
        return "caller"

    async def scenario() -> None:
        cache = TtlCache(ttl_s=0.02, outage_s=0.3)
        assert await cache.fetch("seen", read, (Away,)) == "caller"
        state["away"] = True
        await asyncio.sleep(0.05)  # past ttl twice over: a read is due, and fails
        assert await cache.fetch("seen", read, (Away,)) == "caller"
        reads = state["reads"]
        # Within the outage no request waits on a read: the kept value, one refresh at a time.
        assert [await cache.fetch("seen", read, (Away,)) for _ in range(5)] == ["caller"] * 5
        assert state["reads"] <= reads + 1
        with pytest.raises(Away):
            await cache.fetch("never-seen", read, (Away,))
        await asyncio.sleep(0.3)  # older than outage_s: no longer served
        with pytest.raises(Away):
            await cache.fetch("seen", read, (Away,))
        state["away"] = False
        assert await cache.fetch("seen", read, (Away,)) == "caller"

    asyncio.run(scenario())


def test_an_error_that_is_not_an_outage_is_never_papered_over():
    answers = iter(["caller", ValueError("a bug")])

    async def read() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def scenario() -> None:
        cache = TtlCache(ttl_s=0.02)
        assert await cache.fetch("k", read, (Away,)) == "caller"
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="a bug"):
            await cache.fetch("k", read, (Away,))

    asyncio.run(scenario())


def test_kept_warm_an_entry_in_use_is_read_ahead_so_a_request_after_a_quiet_spell_never_waits():
    reads: list[float] = []

    async def read() -> int:
        reads.append(time.monotonic())
        await asyncio.sleep(0.005)
        return len(reads)

    async def scenario() -> None:
        cache = TtlCache(ttl_s=0.04, keep_warm_s=0.3)
        assert await cache.fetch("k", read) == 1  # a first request reads
        assert await cache.fetch("k", read) == 1  # fetched again: in use, kept warm from now on
        await asyncio.sleep(0.2)  # a quiet spell of five seconds-of-life
        assert len(reads) >= 4  # read ahead in the background meanwhile
        kept = cache._entries["k"]
        assert kept[0] > time.monotonic()  # still fresh: this request waits on nothing
        assert await cache.fetch("k", read) == kept[1]
        await asyncio.sleep(0.45)  # unused for longer than keep_warm_s: no longer read
        quiet = len(reads)
        await asyncio.sleep(0.15)
        assert len(reads) == quiet

    asyncio.run(scenario())


def test_a_key_fetched_once_is_not_kept_warm_and_waiting_requests_share_one_read():
    reads: list[str] = []

    async def read() -> str:
        reads.append("read")
        await asyncio.sleep(0.02)
        return "caller"

    async def scenario() -> None:
        cache = TtlCache(ttl_s=0.02, keep_warm_s=1.0)
        # Five requests at once for a key nobody read yet: one read answers all.
        assert await asyncio.gather(*(cache.fetch("k", read) for _ in range(5))) == ["caller"] * 5
        assert reads == ["read"]
        await asyncio.sleep(0.1)
        assert reads == ["read"]  # a one-off (a random key, say) costs no reads after it

    asyncio.run(scenario())
