"""Each replica's generations as users saw them, for its deployment's page:
time to first token, inter-token latency and tokens per second, per model.

The web tier's doors push one line per finished generation onto the replica's
list in Redis (bounded, expiring; each process sends its lines once a second);
the replica's worker reads the last minute of it at each beat and stores the
percentiles with Triton's figures (deployments.services.telemetry), so they are
charted and pushed like them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np
import redis

from common import redis_async

log = logging.getLogger(__name__)

KEEP = 2000  # lines per replica: at 30 requests a second, a minute's worth
TTL_S = 3600
WINDOW_S = 60.0
# Lines wait in the process this long and go to Redis together: one round trip a
# second, not one per generation on the event loop that serves the next request.
FLUSH_S = 1.0
_waiting: dict[str, list[str]] = {}
_flusher: asyncio.Task | None = None


def _key(replica_id: int) -> str:
    return f"gantry:figures:r{replica_id}"


def record_soon(
    *, replica_id: int, model: str, first_token_s: float | None, inter_token_s: float | None, tokens: int
) -> None:
    """Keep one finished generation's figures for the next push (within FLUSH_S, never in the answer's way)."""
    global _flusher
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # a generation closed outside any loop (collected): nothing to push it from
        return
    line = f"{model}\t{time.time():.3f}\t{_or_dash(first_token_s)}\t{_or_dash(inter_token_s)}\t{tokens}"
    _waiting.setdefault(_key(replica_id), []).append(line)
    if _flusher is None or _flusher.done():
        _flusher = loop.create_task(_push_soon())


def _or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:.6f}"


async def _push_soon() -> None:
    await asyncio.sleep(FLUSH_S)
    waiting = dict(_waiting)
    _waiting.clear()
    try:
        async with redis_async.loop_client().pipeline(transaction=False) as pipe:
            for key, lines in waiting.items():
                pipe.lpush(key, *lines)  # oldest first, so the list stays newest first
                pipe.ltrim(key, 0, KEEP - 1)
                pipe.expire(key, TTL_S)
            await pipe.execute()
    except Exception as exc:  # noqa: BLE001 - figures are best effort; the answers were sent
        log.debug("live figures not recorded: %s", exc)


def read(client: redis.Redis, replica_id: int, *, now: float | None = None) -> dict[str, dict[str, float]]:
    """Per model, over the last WINDOW_S: generations, TTFT and inter-token p50/p99
    (ms) and generated tokens per second. Models with none are left out."""
    now = time.time() if now is None else now
    lines = client.lrange(_key(replica_id), 0, KEEP - 1)
    seen: dict[str, dict[str, Any]] = {}
    for raw in lines:
        try:
            model, at, first, inter, tokens = raw.decode().split("\t")
            at_s = float(at)
        except ValueError:
            continue
        if at_s < now - WINDOW_S:
            break  # newest first: the rest is older
        found = seen.setdefault(model, {"ttft": [], "itl": [], "tokens": 0, "requests": 0, "oldest": at_s})
        found["requests"] += 1
        found["tokens"] += int(tokens)
        found["oldest"] = at_s
        if first != "-":
            found["ttft"].append(float(first) * 1000)
        if inter != "-":
            found["itl"].append(float(inter) * 1000)
    figures: dict[str, dict[str, float]] = {}
    for model, found in seen.items():
        values = {"generations": found["requests"], "tokens_per_s": round(found["tokens"] / WINDOW_S, 3)}
        for name in ("ttft", "itl"):
            if found[name]:
                p50, p99 = np.percentile(found[name], [50, 99])
                values[f"{name}_p50_ms"], values[f"{name}_p99_ms"] = round(float(p50), 3), round(float(p99), 3)
        figures[model] = values
    return figures
