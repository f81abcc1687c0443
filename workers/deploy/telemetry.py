"""What a running server reports, shipped each beat: its new log lines, and
its metrics (Triton's counters turned into rates, GPU figures from Triton or
NVML)."""

from __future__ import annotations

import logging
from pathlib import Path

from common.errors import TransientError
from deployments.models import Replica
from deployments.services import replicas, telemetry
from triton_server import metrics
from triton_server.server import LOCAL, LaunchSpec
from workers import nvml
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
    replica: Replica, inventory: nvml.Inventory | None = None, *, memory: dict[str, int] | None = None
) -> None:
    """Scrape the server's metrics port once and store per-model rates, GPU
    figures and each model's GPU memory as NVML sees it (``memory``, from
    process_memory)."""
    url = f"http://{LOCAL}:{replica.metrics_port}/metrics"
    try:
        current = metrics.scrape(url)
    except TransientError as exc:
        log.info("replica %s: %s", replica.pk, exc)
        return
    handle, previous = _last_scrape.get(replica.pk, ("", None))
    if handle != replica.runtime_handle:
        previous = None  # another server since: its counters started again from zero
    _last_scrape[replica.pk] = (replica.runtime_handle, current)
    models = metrics.derive(previous, current)
    for name, used in (memory or {}).items():
        models.setdefault(name, {})["gpu_memory_bytes"] = used
    telemetry.metrics_record(
        deployment_id=replica.deployment_id,
        replica_id=replica.pk,
        models=models,
        gpus=_gpu_figures(current.gpus, inventory),
    )


def report_readiness(replica: Replica, models: dict[str, bool]) -> None:
    """What Triton said of each model at this check, for the replica's page."""
    telemetry.placements_readiness(replica_id=replica.pk, models=models)
