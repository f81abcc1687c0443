"""What the busiest doors read from the database, kept a moment per process.

Token checks and routes are read on every request of the gateway, the lean
generate path and the REST API; kept for ``ttl_s`` (a second), each is read
once a second per key instead. The price is that a change (a revoked token,
a stopped deployment, a moved alias) takes effect within that second.
"""

from __future__ import annotations

import time
from typing import Any

MISSING = object()


class TtlCache:
    def __init__(self, ttl_s: float = 1.0, max_entries: int = 10_000) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._entries: dict[Any, tuple[float, Any]] = {}

    def get(self, key: Any, default: Any = None) -> Any:
        """The value kept for ``key`` if it is fresh, else ``default``."""
        entry = self._entries.get(key)
        return entry[1] if entry is not None and entry[0] > time.monotonic() else default

    def put(self, key: Any, value: Any) -> Any:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()  # a flood of distinct keys: start again rather than grow
        self._entries[key] = (time.monotonic() + self.ttl_s, value)
        return value

    def clear(self) -> None:
        self._entries.clear()
