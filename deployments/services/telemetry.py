"""What running servers report: metric samples (kept for the retention window)
and server log lines (the newest few kept), stored in one statement each and
pushed to the deployment's page."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from core import events
from deployments.models import BuildLogLine, DeploymentModel, LogLine, MetricSample, Replica
from deployments.services import replicas
from deployments.states import SERVING


def metrics_record(
    *,
    deployment_id: int,
    replica_id: int | None = None,
    models: dict[str, dict[str, float]],
    gpus: dict[str, dict[str, float]],
    held: int = 0,
) -> None:
    """Store one scrape's figures, prune samples past the retention window, and
    push the figures to the deployment's page. ``held``: the requests the server
    held at the scrape (triton_server.metrics.in_flight), which counts a
    generating model's streams after Triton's own figures have let them go."""
    now = timezone.now()
    MetricSample.objects.bulk_create(
        [
            *(
                MetricSample(
                    deployment_id=deployment_id, replica_id=replica_id, at=now, kind="model", subject=k, values=v
                )
                for k, v in models.items()
            ),
            *(
                MetricSample(
                    deployment_id=deployment_id, replica_id=replica_id, at=now, kind="gpu", subject=k, values=v
                )
                for k, v in gpus.items()
            ),
        ]
    )
    if replica_id is not None:
        queue_ms = max((values.get("queue_ms", 0.0) for values in models.values()), default=0.0)
        in_flight = max(
            float(held),
            sum(values.get("pending", 0.0) for values in models.values()),
            sum(values.get("concurrency", 0.0) for values in models.values()),
        )
        Replica.objects.filter(pk=replica_id).update(queue_ms=round(queue_ms, 3), in_flight=round(in_flight, 3))
    cutoff = now - timedelta(hours=settings.GANTRY_METRICS_RETENTION_HOURS)
    MetricSample.objects.filter(deployment_id=deployment_id, at__lt=cutoff).delete()
    events.publish(
        events.deployment_group(deployment_id),
        {
            "type": "metrics",
            "deployment": deployment_id,
            "replica_id": replica_id,
            "at": now.isoformat(),
            "models": models,
            "gpus": gpus,
        },  # fmt: skip
    )
    # The dashboard's sparkline: the deployment's requests per second, all models together.
    events.publish(
        events.DASHBOARD_GROUP,
        {"type": "rate", "deployment": deployment_id, "at": now.isoformat(), "request_rate": request_rate(models)},
    )


def metrics_unreadable(*, replica_id: int, cause: str, source: str, said: bool = False) -> None:
    """A replica's metrics port did not answer its scrape: the cause on the page
    every beat, and on the timeline once (``said``: already there)."""
    replica = Replica.objects.filter(pk=replica_id).values("deployment_id", "serial").first()
    if replica is None:
        return
    if not said:
        replicas.record_replica_event(
            replica_id=replica_id, kind="deployment.metrics_unreadable", source=source,
            message=f"its metrics cannot be read ({cause}); its charts have a gap until they can",
        )  # fmt: skip
    events.publish(
        events.deployment_group(replica["deployment_id"]),
        {"type": "metrics_failed", "deployment": replica["deployment_id"], "replica": replica["serial"],
         "replica_id": replica_id,
         "at": timezone.now().isoformat(), "cause": cause},
    )  # fmt: skip


def metrics_readable(*, replica_id: int, source: str) -> None:
    replicas.record_replica_event(
        replica_id=replica_id, kind="deployment.metrics_readable", source=source,
        message="its metrics are read again",
    )  # fmt: skip


def request_rate(models: dict[str, dict[str, float]]) -> float:
    """A deployment's requests per second: its models' rates summed (a first scrape has none)."""
    return round(sum(values.get("request_rate", 0.0) for values in models.values()), 4)


def request_rates(*, minutes: int, ids: list[int] | None = None) -> dict[int, list[tuple[str, float]]]:
    """Per deployment (or those of ``ids``), its requests per second over the last ``minutes`` (oldest first)."""
    since = timezone.now() - timedelta(minutes=minutes)
    samples = MetricSample.objects.filter(kind="model", at__gte=since)
    if ids is not None:
        samples = samples.filter(deployment_id__in=ids)
    rows = samples.order_by("deployment_id", "at").values_list("deployment_id", "at", "values")
    rates: dict[int, dict[str, float]] = {}
    for deployment_id, at, values in rows:
        series = rates.setdefault(deployment_id, {})
        key = at.isoformat()
        series[key] = round(series.get(key, 0.0) + values.get("request_rate", 0.0), 4)
    return {deployment_id: list(series.items()) for deployment_id, series in rates.items()}


def placements_readiness(*, replica_id: int, models: dict[str, bool], cause: str = "") -> dict[str, bool]:
    """Record what Triton says of each placed model on a replica (by Triton
    name; an engine's helper models are not placements and are left out), and
    whether each placement is ready on every serving replica of its deployment
    (writing only what changed); push that to the deployment's page (each beat:
    a page that re-read a moment too early is right again within one). Returns
    the changes."""
    replica = Replica.objects.filter(pk=replica_id).values("deployment_id", "serial").first()
    if replica is None:
        return {}
    deployment_id = replica["deployment_id"]
    placed = dict(DeploymentModel.objects.filter(deployment_id=deployment_id).values_list("triton_name", "ready"))
    mine = {name: models[name] for name in placed if name in models}
    Replica.objects.filter(pk=replica_id).update(models_ready=mine)
    serving = Replica.objects.filter(deployment_id=deployment_id, status__in=SERVING).exclude(pk=replica_id)
    now = dict(mine)
    for others in serving.values_list("models_ready", flat=True):
        for name, ready in (others or {}).items():
            if name in now:
                now[name] = now[name] and ready
    changed = {name: ready for name, ready in now.items() if placed[name] != ready}
    for value in (True, False):
        names = [name for name, ready in changed.items() if ready is value]
        if names:
            DeploymentModel.objects.filter(deployment_id=deployment_id, triton_name__in=names).update(ready=value)
    if now:
        events.publish(
            events.deployment_group(deployment_id),
            {"type": "models", "deployment": deployment_id, "ready": now,
             "replica": {"serial": replica["serial"], "ready": mine, "cause": cause}},
        )  # fmt: skip
    return changed


# How many log lines a deployment keeps; older ones are deleted as new ones arrive.
LOG_LINES_KEPT = 1000


def log_lines_append(*, deployment_id: int, lines: list[str], replica_id: int | None = None) -> None:
    """Store a batch of a replica's server log lines (one insert), trim the
    deployment's to the newest LOG_LINES_KEPT, and push them."""
    if not lines:
        return
    append_newest_lines(
        LogLine, keep=LOG_LINES_KEPT, lines=lines, columns={"replica_id": replica_id}, deployment_id=deployment_id
    )
    events.publish(events.deployment_group(deployment_id), {"type": "log", "deployment": deployment_id, "lines": lines})


def append_newest_lines(
    model: type[LogLine] | type[BuildLogLine],
    *,
    keep: int,
    lines: list[str],
    columns: dict[str, Any] | None = None,
    **owner: int,
) -> None:
    """Insert ``lines`` for ``owner`` (with ``columns``) in one statement and
    delete all but its newest ``keep``."""
    model.objects.bulk_create(model(**owner, **(columns or {}), line=line[:4000]) for line in lines)
    oldest_kept = model.objects.filter(**owner).order_by("-id").values_list("id", flat=True)[keep:].first()
    if oldest_kept is not None:
        model.objects.filter(**owner, id__lte=oldest_kept).delete()
