"""/metrics on the web and live servers (common.metrics says what each exports).

The web tier adds what the control plane knows at scrape time: the fleet by
status, what waits in the outbox and in each host's Celery queues, and how
long their oldest task has waited. Read in one pass per scrape (a handful of
grouped queries and one Redis pipeline), never kept in the processes.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.db.models import Count, Min
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common import metrics
from common.asgi_io import send_bytes
from core import queues
from deployments.models import Deployment, EngineBuild, Replica
from hosts.models import GpuHost, OutboxMessage
from hosts.outbox import SENT_AT_HEADER
from loadtests.models import LoadTest

log = logging.getLogger(__name__)
PATH = "/metrics"


def owns(scope: dict[str, Any]) -> bool:
    return scope["path"] == PATH


class MetricsDoor:
    """ASGI: GET /metrics, with the scrape token (controlplane.asgi's table)."""

    def __init__(self, *collectors: Collector) -> None:
        self.collectors = collectors

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not metrics.enabled():
            await send_bytes(send, 404, b"metrics are off: set GANTRY_METRICS_TOKEN\n", "text/plain")
            return
        authorization = dict(scope["headers"]).get(b"authorization")
        if not metrics.scrape_allowed(authorization):
            await send_bytes(
                send, 401, metrics.REFUSED, "text/plain",
                headers=[(b"www-authenticate", b'Bearer realm="metrics"')],
            )  # fmt: skip
            return
        body = await sync_to_async(self._render, thread_sensitive=False)()
        await send_bytes(send, 200, body, metrics.CONTENT_TYPE)

    def _render(self) -> bytes:
        try:
            return metrics.exposition(metrics.registry(*self.collectors))
        finally:
            close_old_connections()


class ControlPlane(Collector):
    """What the database and the broker hold, read when Prometheus scrapes."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from _by_status("gantry_deployments", "Deployments by status.", Deployment)
        yield from _by_status("gantry_replicas", "Replicas by status.", Replica)
        yield from _by_status("gantry_builds", "Engine builds by status.", EngineBuild)
        yield from _by_status("gantry_loadtests", "Load tests by status.", LoadTest)
        yield _hosts()
        yield from _outbox()
        yield from _celery_queues()


def _by_status(name: str, help: str, model: type) -> Iterator[GaugeMetricFamily]:
    family = GaugeMetricFamily(name, help, labels=["status"])
    counts = dict(model.objects.values_list("status").annotate(n=Count("id")).order_by())
    for status, _label in model._meta.get_field("status").choices:
        family.add_metric([status], counts.get(status, 0))
    yield family


def _hosts() -> GaugeMetricFamily:
    family = GaugeMetricFamily("gantry_hosts", "GPU hosts by whether they beat lately.", labels=["state"])
    hosts = list(GpuHost.objects.only("last_heartbeat"))
    online = sum(1 for host in hosts if host.is_online)
    family.add_metric(["online"], online)
    family.add_metric(["offline"], len(hosts) - online)
    return family


def _outbox() -> Iterator[GaugeMetricFamily]:
    waiting = OutboxMessage.objects.filter(parked_at__isnull=True).aggregate(n=Count("id"), oldest=Min("created_at"))
    parked = OutboxMessage.objects.filter(parked_at__isnull=False).count()
    family = GaugeMetricFamily(
        "gantry_outbox_messages", "Tasks waiting in the outbox for the broker, or parked (refused).", labels=["state"]
    )
    family.add_metric(["waiting"], waiting["n"])
    family.add_metric(["parked"], parked)
    yield family
    age = (timezone.now() - waiting["oldest"]).total_seconds() if waiting["oldest"] else 0.0
    yield GaugeMetricFamily(
        "gantry_outbox_oldest_age_seconds", "How long the oldest waiting outbox task has waited (0: none).", value=age
    )


def _celery_queues() -> Iterator[GaugeMetricFamily]:
    """Each host queue's length and its oldest task's wait (Kombu pushes on the
    left and workers take from the right: the oldest is at index -1)."""
    names = [name for host in GpuHost.objects.values_list("name", flat=True) for name in queues.host_queues(host)]
    length = GaugeMetricFamily("gantry_celery_queue_length", "Tasks waiting in a host's queue.", labels=["queue"])
    age = GaugeMetricFamily(
        "gantry_celery_oldest_task_age_seconds",
        "How long the oldest task in a host's queue has waited since the broker took it (0: none).",
        labels=["queue"],
    )
    try:
        with _broker(settings.CELERY_BROKER_URL).pipeline(transaction=False) as pipe:
            for name in names:
                pipe.llen(name)
                pipe.lindex(name, -1)
            answers = pipe.execute()
    except redis.RedisError as exc:
        log.warning("metrics: the broker did not answer: %s", exc)
        return
    now = time.time()
    for index, name in enumerate(names):
        waiting, oldest = answers[2 * index], answers[2 * index + 1]
        length.add_metric([name], waiting)
        age.add_metric([name], max(0.0, now - _sent_at(oldest)) if oldest else 0.0)
    yield length
    yield age


@functools.cache
def _broker(url: str) -> redis.Redis:
    """The broker's client, kept between scrapes (its pool reconnects after an outage),
    named for its process in the broker's CLIENT LIST."""
    return redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1, client_name=broker_client_name())


def broker_client_name() -> str:
    return f"gantry-metrics-{os.getpid()}"


def _sent_at(message: bytes) -> float:
    try:
        sent = json.loads(message).get("headers", {}).get(SENT_AT_HEADER)
    except (ValueError, AttributeError):
        return time.time()
    return float(sent) if isinstance(sent, int | float) else time.time()
