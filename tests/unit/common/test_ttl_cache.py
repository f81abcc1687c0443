"""The per-process second-long cache the busiest doors read through."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.ttl_cache import MISSING, Breaker, DatabaseAway, TtlCache


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
        breaker = Breaker(probe_s=0.1)
        cache = TtlCache(ttl_s=0.02, outage_s=0.3, breaker=breaker)
        assert await cache.fetch("seen", read, (Away,)) == "caller"
        state["away"] = True
        await asyncio.sleep(0.05)  # past ttl twice over: a read is due, and fails: the breaker opens
        assert await cache.fetch("seen", read, (Away,)) == "caller"
        assert breaker.is_open and "connection refused" in breaker.cause
        reads = state["reads"]
        # While it is open no request waits on a read: the kept value; a key never read fails at
        # once, without a read of its own; one probe per probe_s asks the database again.
        assert [await cache.fetch("seen", read, (Away,)) for _ in range(5)] == ["caller"] * 5
        with pytest.raises(DatabaseAway, match="the database is away \\(connection refused\\)"):
            await cache.fetch("never-seen", read, (Away,))
        await asyncio.sleep(0)
        assert state["reads"] <= reads + 1
        await asyncio.sleep(0.3)  # older than outage_s: no longer served
        with pytest.raises(DatabaseAway):
            await cache.fetch("seen", read, (Away,))  # refused; the probe it starts asks again
        # Back before that probe reads: it closes the breaker, and reads are as before.
        state["away"] = False
        await asyncio.sleep(0.01)
        assert not breaker.is_open
        assert await cache.fetch("seen", read, (Away,)) == "caller"

    asyncio.run(scenario())


def test_a_read_that_waits_on_a_database_gone_quiet_opens_the_breaker_and_no_one_waits_behind_it():
    # A stopped PostgreSQL makes a read wait the pool's whole timeout, not fail: after
    # away_after_s the breaker opens; a known key is served meanwhile, an unknown one refused.
    gate = asyncio.Event()

    async def read() -> str:
        await gate.wait()
        return "fresh"

    async def scenario() -> None:
        breaker = Breaker(probe_s=10, away_after_s=0.05)
        cache = TtlCache(ttl_s=0.5, breaker=breaker)
        cache.put("known", "kept")
        cache._entries["known"] = (time.monotonic() - 1.1, "kept")  # past ttl twice over
        started = time.monotonic()
        assert await cache.fetch("known", read, (Away,)) == "kept"
        assert breaker.is_open and "a read waited 0.05s" in breaker.cause
        # Its read is still under way: the next request is served at once, not queued behind it.
        assert await cache.fetch("known", read, (Away,)) == "kept"
        with pytest.raises(DatabaseAway):
            await cache.fetch("unknown", read, (Away,))
        assert time.monotonic() - started < 1.0  # no request waited a probe's 10 s
        gate.set()
        await asyncio.sleep(0.01)
        assert not breaker.is_open and cache.get("known") == "fresh"

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
