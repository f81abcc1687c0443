"""What the busiest doors read from the database, kept a moment per process.

Token checks and routes are read on every request of the gateway, the lean
generate path and the REST API; kept for ``ttl_s`` (a second), each is read
once a second per key instead. The price is that a change (a revoked token,
a stopped deployment, a moved alias) takes effect within that second.

The gateway reads through fetch(): past its second a value is still served,
for at most one second more, while one background read replaces it, so no
request waits on the database but a key's first (or one after a quiet spell).

The database's outages go through a breaker (``Breaker``, one per process):
it opens when a read fails with an ``outage`` error, or when a key's read
has waited ``away_after_s`` (a stopped PostgreSQL makes each read wait the
pool's whole timeout). While it is open no request waits on a read: the last
value read is served for up to ``outage_s``, as it was when read (a key
revoked before the outage stays revoked), a key never read fails at once
(``DatabaseAway``), and one read every ``probe_s``, in the background, asks
again; the first that succeeds closes it. A value whose read is already under
way is served too, rather than waited behind it.

With ``keep_warm_s``, an entry fetched again within that time is read again
in the background before its second ends, so a request after a quiet spell does not
wait on the database either (and a change still takes effect within the
second). Requests that find no usable value share one read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

MISSING = object()


class DatabaseAway(Exception):
    """fetch() has no value to serve while the breaker is open."""


class Breaker:
    """Whether the database answers this process's cached reads (see above)."""

    def __init__(self, *, probe_s: float = 1.0, away_after_s: float = 2.0) -> None:
        self.probe_s, self.away_after_s = probe_s, away_after_s
        self.opened_at: float | None = None
        self.cause = ""
        self._probed_at = 0.0

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    def open(self, cause: str) -> None:
        if self.opened_at is None:
            self.opened_at, self.cause = time.monotonic(), cause
            log.warning("database away (%s): cached reads serve what they hold, unknown keys fail at once", cause)

    def close(self) -> None:
        if self.opened_at is not None:
            log.warning("database answers again after %.1fs away", time.monotonic() - self.opened_at)
            self.opened_at = None

    def may_read(self, now: float) -> bool:
        """Whether a background read may start now: always while closed; open, one per probe_s."""
        if self.opened_at is None:
            return True
        if now - self._probed_at < self.probe_s:
            return False
        self._probed_at = now
        return True

    def away(self) -> DatabaseAway:
        return DatabaseAway(f"the database is away ({self.cause})")


# The process's one breaker: every cache of the gateway reads the same database.
BREAKER = Breaker()


class TtlCache:
    def __init__(
        self,
        ttl_s: float = 1.0,
        max_entries: int = 10_000,
        outage_s: float = 300.0,
        keep_warm_s: float = 0.0,
        breaker: Breaker = BREAKER,
    ) -> None:
        self.ttl_s, self.max_entries, self.outage_s, self.keep_warm_s = ttl_s, max_entries, outage_s, keep_warm_s
        self.breaker = breaker
        self._entries: dict[Any, tuple[float, Any]] = {}
        self._refreshing: dict[Any, asyncio.Task] = {}
        self._reading: dict[Any, asyncio.Task] = {}  # a read requests wait on, shared
        # keep_warm_s: key -> (when it was last fetched, its read, its outage errors)
        self._used: dict[Any, tuple[float, Callable[[], Awaitable[Any]], tuple[type[BaseException], ...]]] = {}
        self._keeper: asyncio.Task | None = None

    def get(self, key: Any, default: Any = None) -> Any:
        """The value kept for ``key`` if it is fresh, else ``default``."""
        entry = self._entries.get(key)
        return entry[1] if entry is not None and entry[0] > time.monotonic() else default

    def put(self, key: Any, value: Any) -> Any:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()  # a flood of distinct keys: start again rather than grow
        self._entries[key] = (time.monotonic() + self.ttl_s, value)
        return value

    async def fetch(
        self, key: Any, read: Callable[[], Awaitable[Any]], outage: tuple[type[BaseException], ...] = ()
    ) -> Any:
        """The value for ``key``: kept and fresh, else stale by less than ttl_s (while
        one background read() replaces it), else read() now. With ``outage`` errors
        named, the breaker's rules (above) hold."""
        entry = self._entries.get(key)
        now = time.monotonic()
        if self.keep_warm_s and entry is not None:  # fetched again: in use (a one-off, a random key, is not)
            self._keep_warm(key, read, outage, now)
        if entry is not None and entry[0] > now:
            return entry[1]
        guarded = bool(outage)
        kept = guarded and entry is not None and entry[0] + self.outage_s > now
        reading = key in self._refreshing or key in self._reading
        if entry is not None and (entry[0] + self.ttl_s > now or (kept and (self.breaker.is_open or reading))):
            self._read_behind(key, read, outage, now)
            return entry[1]
        if guarded and self.breaker.is_open:
            self._read_behind(key, read, outage, now)  # a probe, when one is due
            raise self.breaker.away()
        try:
            if not guarded:
                return await self._shared_read(key, read, outage)
            return await asyncio.wait_for(self._shared_read(key, read, outage), self.breaker.away_after_s)
        except TimeoutError:
            self.breaker.open(f"a read waited {self.breaker.away_after_s:g}s")
            if not kept:
                raise self.breaker.away() from None
            return entry[1]
        except outage as exc:
            if not kept:
                raise
            log.warning("serving a cached %r while its read fails: %s", key, exc)
            return entry[1]

    async def _read_and_keep(
        self, key: Any, read: Callable[[], Awaitable[Any]], outage: tuple[type[BaseException], ...]
    ) -> Any:
        """read() kept under ``key``, whoever still waits for it; what it says of the database, to the breaker."""
        try:
            value = await read()
        except outage as exc:
            self.breaker.open(str(exc).strip() or type(exc).__name__)
            raise
        if outage:
            self.breaker.close()
        return self.put(key, value)

    def _read_behind(
        self, key: Any, read: Callable[[], Awaitable[Any]], outage: tuple[type[BaseException], ...], now: float
    ) -> None:
        """Read ``key`` again in the background, unless a read of it is under way or the breaker holds it back."""
        if key not in self._refreshing and key not in self._reading and self.breaker.may_read(now):
            self._refreshing[key] = asyncio.get_running_loop().create_task(self._refresh(key, read, outage))

    async def _shared_read(
        self, key: Any, read: Callable[[], Awaitable[Any]], outage: tuple[type[BaseException], ...]
    ) -> Any:
        """read(), once for every request waiting on ``key`` at the same time (one
        that goes away leaves the read to the others)."""
        task = self._reading.get(key)
        if task is None:
            task = self._reading[key] = asyncio.get_running_loop().create_task(self._read_and_keep(key, read, outage))
            task.add_done_callback(lambda _: self._reading.pop(key, None))
        return await asyncio.shield(task)

    def _keep_warm(
        self, key: Any, read: Callable[[], Awaitable[Any]], outage: tuple[type[BaseException], ...], now: float
    ) -> None:
        if len(self._used) >= self.max_entries and key not in self._used:
            self._used.clear()
        self._used[key] = (now, read, outage)
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.get_running_loop().create_task(self._keep())

    async def _keep(self) -> None:
        """Every half second-of-life, read again what was fetched lately and expires soon."""
        while self._used:
            await asyncio.sleep(self.ttl_s / 2)
            now = time.monotonic()
            for key, (used_at, read, outage) in list(self._used.items()):
                if now - used_at > self.keep_warm_s:
                    del self._used[key]
                    continue
                entry = self._entries.get(key)
                if entry is None or entry[0] - now < self.ttl_s / 2:
                    self._read_behind(key, read, outage, now)

    async def _refresh(
        self, key: Any, read: Callable[[], Awaitable[Any]], outage: tuple[type[BaseException], ...]
    ) -> None:
        try:
            await self._read_and_keep(key, read, outage)
        except Exception as exc:  # noqa: BLE001 - the stale value ages out; the next request reads itself
            log.warning("refreshing a cached %r failed: %s", key, exc)
        finally:
            self._refreshing.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()
        self._used.clear()
