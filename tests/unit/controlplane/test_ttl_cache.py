"""The per-process second-long cache the busiest doors read through."""

from __future__ import annotations

import time

from controlplane.ttl_cache import MISSING, TtlCache


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
