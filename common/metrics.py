"""Gantry's own Prometheus metrics: their definitions, how each process kind
exports them on /metrics, and the scrape token that guards it. The one home of
prometheus_client for what Gantry measures (triton_server.metrics reads what
Triton measures).

- web (gunicorn, several processes) and a GPU host's worker (two Celery
  workers and their children) run prometheus_client's multiprocess mode: each
  process writes its samples to files in PROMETHEUS_MULTIPROC_DIR, which the
  process tree's parent makes empty at start (common.metrics_folder), and
  a scrape of any one process reads them all;
- live (one daphne process) keeps its own in memory.

Metrics are recorded only while a scrape token is set (GANTRY_METRICS_TOKEN):
without one nobody can read them, so nothing is spent on them, and /metrics
answers 404.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from functools import cache
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import REGISTRY, Collector

from common import metrics_folder

CONTENT_TYPE = CONTENT_TYPE_LATEST
REFUSED = b"send the scrape token: Authorization: Bearer <GANTRY_METRICS_TOKEN>\n"  # a 401's body

# Latency buckets (seconds): from a cached embedding (1 ms) to a long generation (2 min).
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Time to first token and between tokens: finer where decoders live (5-200 ms).
_TOKEN_TIME = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5, 10)
_TOKENS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# Builds take minutes to an hour; load tests seconds to an hour.
_JOB = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)

_DOOR = ("door", "alias", "model")

REQUESTS = Counter(
    "gantry_requests",
    "Requests at Gantry's inference doors, by outcome (ok, refused: 4xx, error: 5xx) and HTTP code.",
    ["door", "alias", "key", "model", "code", "outcome"],
)
REQUEST_DURATION = Histogram(
    "gantry_request_duration_seconds", "Whole request time at an inference door.", _DOOR, buckets=_LATENCY
)
TIME_TO_FIRST_TOKEN = Histogram(
    "gantry_time_to_first_token_seconds",
    "From a streamed generation's arrival to its first token leaving Gantry.",
    _DOOR,
    buckets=_TOKEN_TIME,
)
INTER_TOKEN_LATENCY = Histogram(
    "gantry_inter_token_latency_seconds",
    "A streamed generation's mean time between tokens after the first: (end - first token) / (tokens - 1).",
    _DOOR,
    buckets=_TOKEN_TIME,
)
PROMPT_TOKENS = Histogram("gantry_prompt_tokens", "Prompt tokens per request.", _DOOR, buckets=_TOKENS)
COMPLETION_TOKENS = Histogram("gantry_completion_tokens", "Generated tokens per request.", _DOOR, buckets=_TOKENS)

LIVE_SOCKETS = Gauge("gantry_live_sockets", "Websockets open on the live server.", multiprocess_mode="livesum")
LIVE_MESSAGES = Counter("gantry_live_messages", "Live messages sent to browsers' sockets.")
LIVE_MESSAGES_LOST = Counter(
    "gantry_live_messages_lost",
    "Live messages lost: dropped by a publisher that could not reach Redis, or missing from "
    "a socket's numbering (the channel layer dropped them).",
    ["where"],
)
LIVE_MESSAGES_REFUSED = Counter(
    "gantry_live_messages_refused",
    "Live messages a joined host sent about work that is not its own, dropped by the relay.",
    ["host"],
)

BUILD_DURATION = Histogram(
    "gantry_build_duration_seconds", "Engine builds from start to end, by outcome.", ["outcome"], buckets=_JOB
)
LOADTEST_DURATION = Histogram(
    "gantry_loadtest_duration_seconds", "Load tests from start to end, by outcome.", ["outcome"], buckets=_JOB
)
WORKER_TASKS = Counter("gantry_worker_tasks", "Tasks a host's workers ran, by task and state.", ["task", "state"])


@cache
def token() -> str:
    """The scrape token (GANTRY_METRICS_TOKEN); empty: metrics off."""
    from django.conf import settings

    return settings.GANTRY_METRICS_TOKEN


def enabled() -> bool:
    return bool(token())


def scrape_allowed(authorization: str | bytes | None) -> bool:
    """Whether an Authorization header carries the scrape token (``Bearer <token>``)."""
    expected = token()
    if not expected or not authorization:
        return False
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected.encode())


def process_exited(pid: int) -> None:
    """Drop a dead child's live gauges (its counters stay counted)."""
    if os.environ.get(metrics_folder.ENV):
        multiprocess.mark_process_dead(pid)


def registry(*extra: Collector) -> CollectorRegistry:
    """What this process's /metrics shows: every process's samples in multiprocess
    mode, else this process's own, and ``extra`` collectors read at scrape time."""
    if os.environ.get(metrics_folder.ENV):
        found = CollectorRegistry()
        multiprocess.MultiProcessCollector(found)
    else:
        found = CollectorRegistry()
        found.register(_Own())
    for collector in extra:
        found.register(collector)
    return found


class _Own(Collector):
    """The default registry's metrics (Gantry's and the process's own), borrowed by a
    registry that adds collectors of its own without registering them globally."""

    def collect(self) -> Iterable[Any]:
        return REGISTRY.collect()


def exposition(found: CollectorRegistry) -> bytes:
    return generate_latest(found)


# Each label set's children, looked up once (labels() validates its arguments every call).
_TIMED = (REQUEST_DURATION, TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, PROMPT_TOKENS, COMPLETION_TOKENS)
_requests: dict[tuple, Any] = {}
_timed: dict[tuple, tuple] = {}


def observe_door(
    *,
    door: str,
    alias: str,
    key: str,
    model: str,
    code: int,
    duration_s: float,
    first_token_s: float | None = None,
    inter_token_s: float | None = None,
    prompt_tokens: int | None = None,
    completion_tokens: int | None = None,
) -> None:
    """One request at an inference door, whatever its end."""
    if not enabled():
        return
    outcome = "ok" if code < 400 else "refused" if code < 500 else "error"
    counted = (door, alias, key, model, code)
    requests = _requests.get(counted)
    if requests is None:
        requests = _requests[counted] = REQUESTS.labels(door, alias, key, model, str(code), outcome)
    requests.inc()
    labels = (door, alias, model)
    timed = _timed.get(labels)
    if timed is None:
        timed = _timed[labels] = tuple(metric.labels(*labels) for metric in _TIMED)
    duration, first, inter, prompt, completion = timed
    duration.observe(duration_s)
    if first_token_s is not None:
        first.observe(first_token_s)
    if inter_token_s is not None:
        inter.observe(inter_token_s)
    if prompt_tokens:
        prompt.observe(prompt_tokens)
    if completion_tokens:
        completion.observe(completion_tokens)


def count(metric: Counter, *labels: str, amount: float = 1) -> None:
    """``metric`` (a counter) plus ``amount``, while metrics are on."""
    if enabled():
        (metric.labels(*labels) if labels else metric).inc(amount)


def observe(metric: Histogram, value: float, *labels: str) -> None:
    if enabled():
        (metric.labels(*labels) if labels else metric).observe(value)


def gauge_add(metric: Gauge, value: float) -> None:
    if enabled():
        metric.inc(value)
