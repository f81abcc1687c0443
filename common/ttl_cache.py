"""What the busiest doors read from the database, kept a moment per process.

Token checks and routes are read on every request of the gateway, the lean
generate path and the REST API; kept for ``ttl_s`` (a second), each is read
once a second per key instead. The price is that a change (a revoked token,
a stopped deployment, a moved alias) takes effect within that second.

The gateway reads through fetch(): past its second a value is still served,
for at most one second more, while one background read replaces it, so no
request waits on the database but a key's first (or one after a quiet spell).
While reads fail with an ``outage`` error (the database is away), the last
value read is served for up to ``outage_s``, as it was when read (a key
revoked before the outage stays revoked), and a key never read fails.

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


class TtlCache:
    def __init__(
        self, ttl_s: float = 1.0, max_entries: int = 10_000, outage_s: float = 300.0, keep_warm_s: float = 0.0
    ) -> None:
        self.ttl_s, self.max_entries, self.outage_s, self.keep_warm_s = ttl_s, max_entries, outage_s, keep_warm_s
        self._entries: dict[Any, tuple[float, Any]] = {}
        self._refreshing: dict[Any, asyncio.Task] = {}
        self._reading: dict[Any, asyncio.Task] = {}  # a read requests wait on, shared
        self._outage_until = 0.0  # reads failed with an outage error: until then, no request waits on one
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
        one background read() replaces it), else read() now. When read() fails with
        an ``outage`` error, the kept value if it is younger than outage_s."""
        entry = self._entries.get(key)
        now = time.monotonic()
        if self.keep_warm_s and entry is not None:  # fetched again: in use (a one-off, a random key, is not)
            self._keep_warm(key, read, outage, now)
        if entry is not None and entry[0] > now:
            return entry[1]
        usable = entry is not None and (
            entry[0] + self.ttl_s > now or (now < self._outage_until and entry[0] + self.outage_s > now)
        )
        if usable:
            if key not in self._refreshing:
                self._refreshing[key] = asyncio.get_running_loop().create_task(self._refresh(key, read, outage))
            return entry[1]
        try:
            return self.put(key, await self._shared_read(key, read))
        except outage as exc:
            self._outage_until = time.monotonic() + self.ttl_s
            if entry is None or entry[0] + self.outage_s <= now:
                raise
            log.warning("serving a cached %r while its read fails: %s", key, exc)
            return entry[1]

    async def _shared_read(self, key: Any, read: Callable[[], Awaitable[Any]]) -> Any:
        """read(), once for every request waiting on ``key`` at the same time (one
        that goes away leaves the read to the others)."""
        task = self._reading.get(key)
        if task is None:
            task = self._reading[key] = asyncio.get_running_loop().create_task(read())
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
                due = entry is None or entry[0] - now < self.ttl_s / 2
                if due and key not in self._refreshing and key not in self._reading and now >= self._outage_until:
                    self._refreshing[key] = asyncio.get_running_loop().create_task(self._refresh(key, read, outage))

    async def _refresh(
        self, key: Any, read: Callable[[], Awaitable[Any]], outage: tuple[type[BaseException], ...]
    ) -> None:
        try:
            self.put(key, await read())
        except Exception as exc:  # noqa: BLE001 - the stale value ages out; the next request reads itself
            if isinstance(exc, outage):
                self._outage_until = time.monotonic() + self.ttl_s
            log.warning("refreshing a cached %r failed: %s", key, exc)
        finally:
            self._refreshing.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()
        self._used.clear()
