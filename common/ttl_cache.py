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
    def __init__(self, ttl_s: float = 1.0, max_entries: int = 10_000, outage_s: float = 300.0) -> None:
        self.ttl_s, self.max_entries, self.outage_s = ttl_s, max_entries, outage_s
        self._entries: dict[Any, tuple[float, Any]] = {}
        self._refreshing: dict[Any, asyncio.Task] = {}
        self._outage_until = 0.0  # reads failed with an outage error: until then, no request waits on one

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
            return self.put(key, await read())
        except outage as exc:
            self._outage_until = time.monotonic() + self.ttl_s
            if entry is None or entry[0] + self.outage_s <= now:
                raise
            log.warning("serving a cached %r while its read fails: %s", key, exc)
            return entry[1]

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
