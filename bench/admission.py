"""Benchmark: the gateway's admission of a key with limits (one Lua step in
Redis that checks the request and token limits and reserves the tokens),
against its floor, a plain Redis INCR on the same connection. Both run on one
event loop against the Redis at REDIS_URL, alternating rounds; p50/p99 from
at least 1000 samples a side.

Target: admission p99 under 0.3 ms.

    make bench-admission            # or: python bench/admission.py --help
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import percentile  # noqa: E402


def _django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("SECRET_KEY", "gantry-bench-admission")
    os.environ.setdefault("DATABASE_URL", "sqlite:///:memory:")
    import django

    django.setup()


async def _run(rounds: int, per_round: int) -> dict[str, list[float]]:
    from common.redis_async import loop_client
    from gateway import metering
    from gateway.access import Caller

    # Limits no round reaches: every admission is admitted (the common case to price).
    caller = Caller(key_id=987654321, all_aliases=True, aliases=frozenset(), expires_at=None,
                    requests_per_minute=10**9, tokens_per_minute=10**12)  # fmt: skip
    client = loop_client()
    await client.ping()

    async def admit() -> None:
        admission = await metering.admit(caller, "bench", reserve=300)
        assert admission.reserved == 300

    async def floor() -> None:
        await client.incr("gantry:bench:admission:floor")

    sides = {"admission": admit, "floor (INCR)": floor}
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for call in sides.values():  # warm: the script is loaded once, connections made
        for _ in range(50):
            await call()
    for n in range(rounds):
        order = list(sides) if n % 2 == 0 else list(reversed(sides))
        for name in order:
            for _ in range(per_round):
                started = time.perf_counter()
                await sides[name]()
                samples[name].append((time.perf_counter() - started) * 1000)
    metering.usage.counts.clear()
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=500)
    args = parser.parse_args()
    _django()
    samples = asyncio.run(_run(args.rounds, args.per_round))
    print(f"Gateway admission with limits, {len(samples['admission'])} samples a side (Redis at REDIS_URL)")
    for name, values in samples.items():
        print(f"{name:<16} p50 {percentile(values, 0.5):.3f} ms   p99 {percentile(values, 0.99):.3f} ms")
    ratio = percentile(samples["admission"], 0.99) / percentile(samples["floor (INCR)"], 0.99)
    print(f"admission p99 {percentile(samples['admission'], 0.99):.3f} ms (target < 0.3 ms); {ratio:.2f}x the floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
