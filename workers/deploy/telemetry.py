"""What a running server reports, shipped each beat: its new log lines, and
its metrics (Triton's counters turned into rates, GPU figures from Triton or
NVML)."""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path

import redis
from django.conf import settings

from common.errors import TransientError
from deployments import gpu_plan, live_figures
from deployments.models import Replica
from deployments.services import replicas, telemetry
from triton_server import metrics
from triton_server.server import LaunchSpec
from workers import exporter, nvml
from workers.jobs import source
from workers.runtimes.base import Runtime

log = logging.getLogger(__name__)


# Where each replica's server log was last read, per server (handle).
_log_cursor: dict[int, tuple[str, float]] = {}
# The server (handle) of each replica whose log could not be read, once said so.
_log_unreadable: dict[int, str] = {}


def ship_log(replica: Replica, runtime: Runtime, spec: LaunchSpec) -> None:
    """Store the server log lines written since the last beat. A log that cannot
    be read is said on the replica's timeline, once for each server."""
    if not replica.runtime_handle:
        return
    handle, cursor = _log_cursor.get(replica.pk, ("", None))
    if handle != replica.runtime_handle:
        cursor = None
    try:
        lines, cursor = runtime.read_log(replica.runtime_handle, spec, cursor)
    except TransientError as exc:
        if _log_unreadable.get(replica.pk) != replica.runtime_handle:
            _log_unreadable[replica.pk] = replica.runtime_handle
            replicas.record_replica_event(
                replica_id=replica.pk,
                kind="deployment.log_unreadable",
                source=source(),
                message=f"{exc}; the server's lines are missing from its log until it can be read again",
            )
        return
    _log_unreadable.pop(replica.pk, None)
    _log_cursor[replica.pk] = (replica.runtime_handle, cursor)
    telemetry.log_lines_append(deployment_id=replica.deployment_id, replica_id=replica.pk, lines=lines)


# The previous scrape of each replica's server (and which server it was),
# to turn cumulative counters into rates.
_last_scrape: dict[int, tuple[str, metrics.Scrape]] = {}


def _gpu_figures(triton: dict[str, dict[str, float]], inventory: nvml.Inventory | None) -> dict[str, dict[str, float]]:
    """Triton's GPU gauges, or NVML's where Triton reads none or only zeros
    (its DCGM-based metrics are missing in some images and containers)."""
    if any(any(values.values()) for values in triton.values()) or inventory is None:
        return triton
    return {
        gpu.uuid: {
            "utilization": gpu.utilization_percent / 100,
            "memory_used_bytes": gpu.memory_used_bytes,
            "memory_total_bytes": gpu.memory_total_bytes,
            "source": "nvml",
        }
        for gpu in inventory.gpus
    }


STUB = "triton_python_backend_stub"
SERVER = "tritonserver"


def process_memory(pids: list[int], gpu_indexes: tuple[int, ...]) -> dict[str, int]:
    """NVML's GPU memory of a server's processes, by what they run: each python
    model's stubs under the model's name (a stub runs <repository>/<model>/1/model.py),
    everything else (tritonserver, an engine inside it) under "tritonserver"."""
    if not gpu_indexes or not pids:
        return {}
    used = nvml.compute_processes(gpu_indexes)
    found: dict[str, int] = {}
    for pid in pids:
        if pid in used:
            name = _stub_model(pid) or SERVER
            found[name] = found.get(name, 0) + used[pid]
    return found


def _stub_model(pid: int) -> str:
    try:
        argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    if len(argv) < 2 or not argv[0].endswith(STUB.encode()):
        return ""
    parts = Path(argv[1].decode(errors="replace")).parts
    return parts[-3] if len(parts) >= 3 else ""


def collect_metrics(
    replica: Replica,
    inventory: nvml.Inventory | None = None,
    *,
    memory: dict[str, int] | None = None,
    gpu_ids: tuple[int, ...] = (),
) -> None:
    """Scrape the server's metrics port once and store per-model rates, GPU
    figures, each model's GPU memory as NVML sees it (``memory``, from
    process_memory) and what the doors saw of its generations (TTFT, inter-token
    latency, tokens/s: deployments.live_figures). Keep all of it for the host's
    /metrics (workers.exporter). A failed scrape says why on the timeline and
    the page, once per cause, and again when figures are back."""
    url = metrics.local_url(replica.metrics_port)
    labels = exporter.replica_labels(deployment=replica.deployment.name, replica_id=replica.pk, serial=replica.serial)
    try:
        current = metrics.scrape(url)
    except TransientError as exc:
        exporter.scrape_failed(replica.pk, labels)
        cause = str(exc)
        said = _scrape_failing.get(replica.pk) == cause
        _scrape_failing[replica.pk] = cause
        telemetry.metrics_unreadable(replica_id=replica.pk, cause=cause, source=source(), said=said)
        return
    if _scrape_failing.pop(replica.pk, None) is not None:
        telemetry.metrics_readable(replica_id=replica.pk, source=source())
    exporter.keep_scrape(replica.pk, labels, current.text)
    handle, previous = _last_scrape.get(replica.pk, ("", None))
    if handle != replica.runtime_handle:
        previous = None  # another server since: its counters started again from zero
    _last_scrape[replica.pk] = (replica.runtime_handle, current)
    models = metrics.derive(previous, current)
    for name, used in (memory or {}).items():
        models.setdefault(name, {})["gpu_memory_bytes"] = used
    exporter.keep_memory(replica.pk, labels, memory or {}, _planned_memory(replica, inventory, gpu_ids))
    for name, values in _generations(replica.pk).items():
        models.setdefault(name, {}).update(values)
    telemetry.metrics_record(
        deployment_id=replica.deployment_id,
        replica_id=replica.pk,
        models=models,
        gpus=_gpu_figures(current.gpus, inventory),
        held=metrics.in_flight(current),
    )


# Each replica whose last scrape failed, and why (said on the timeline once per cause).
_scrape_failing: dict[int, str] = {}


@cache
def _redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=2)


def _generations(replica_id: int) -> dict[str, dict[str, float]]:
    try:
        return live_figures.read(_redis(), replica_id)
    except redis.RedisError as exc:
        log.debug("live figures of replica %s unread: %s", replica_id, exc)
        return {}


def _planned_memory(replica: Replica, inventory: nvml.Inventory | None, gpu_ids: tuple[int, ...]) -> dict[str, int]:
    """What the plan gave each placement on this replica's GPUs: its share of each."""
    if inventory is None or not inventory.gpus:
        return {}
    totals = {gpu.index: gpu.memory_total_bytes for gpu in inventory.gpus}
    gpus = [totals[i] for i in gpu_ids if i in totals]
    if not gpus:
        return {}
    return {p.triton_name: int(gpu_plan.share_of(p) * sum(gpus)) for p in replica.deployment.placements.all()}


def report_readiness(replica: Replica, models: dict[str, bool], cause: str = "") -> None:
    """What Triton said of each model at this check (and why some are not ready), for the replica's page."""
    telemetry.placements_readiness(replica_id=replica.pk, models=models, cause=cause)
