"""A GPU host's /metrics, served by the host agent's process on
GANTRY_WORKER_METRICS_PORT (GANTRY_HOST_ADDRESS), with the scrape token.

One scrape per host is enough. It shows:
- the worker's own figures (common.metrics: tasks, build and load-test
  durations), from every process of the host worker (multiprocess mode);
- what each Triton server on the host reported at its last scrape (the agent
  reads each replica's metrics port on loopback every beat), its samples
  relabelled with ``deployment`` and ``replica`` beside Triton's ``model``;
  Triton's own GPU and CPU gauges are left out, as every server repeats them;
- the GPUs as NVML sees them (utilisation, memory, power) and the GPU memory
  of each model's processes against what the plan gave it;
- ``gantry_replica_scrape_ok``: whether a replica's last scrape succeeded.

Scraping Triton happens at the beat, not at the scrape: a Prometheus scrape
serialises what the beat kept, so its time does not grow with the servers'.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from common import metrics
from hosts.services.hosts import GpuReport

log = logging.getLogger(__name__)

# Triton's gauges of the whole machine: NVML's figures stand for them, once per GPU.
_HOST_WIDE = ("nv_gpu_", "nv_cpu_", "nv_energy_")

_lock = threading.Lock()
# Per replica: its relabelled Triton families (name: header lines, sample lines), scrape state, labels.
_replicas: dict[int, tuple[dict[str, tuple[list[str], list[str]]], bool, dict[str, str]]] = {}
_gpus: list[Metric] = []
_processes: dict[int, list[tuple[dict[str, str], float, float]]] = {}  # replica: (labels, used, planned)


def replica_labels(*, deployment: str, replica_id: int, serial: int) -> dict[str, str]:
    return {"deployment": deployment, "replica": f"r{serial}", "replica_id": str(replica_id)}


def keep_scrape(replica_id: int, labels: dict[str, str], text: str) -> None:
    """A replica's Triton exposition as read this beat, relabelled once here. Kept as
    text, so Triton's names stay as they are (a parser would rename its counters)."""
    extra = ",".join(f'{name}="{_escape(value)}"' for name, value in labels.items())
    families: dict[str, tuple[list[str], list[str]]] = {}
    current: tuple[list[str], list[str]] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                name = parts[2]
                current = None if name.startswith(_HOST_WIDE) else families.setdefault(name, ([], []))
                if current is not None and len(current[0]) < 2:
                    current[0].append(line)
            continue
        if current is None:
            continue
        name, brace, rest = line.partition("{")
        if brace:
            current[1].append(f"{name}{{{extra},{rest}" if not rest.startswith("}") else f"{name}{{{extra}{rest}")
        else:
            name, _, value = line.partition(" ")
            current[1].append(f"{name}{{{extra}}} {value}")
    with _lock:
        _replicas[replica_id] = (families, True, labels)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def scrape_failed(replica_id: int, labels: dict[str, str]) -> None:
    """The replica's server did not answer its scrape: its figures go, ``up`` says 0."""
    with _lock:
        _replicas[replica_id] = ({}, False, labels)


def keep_memory(replica_id: int, labels: dict[str, str], used: dict[str, int], planned: dict[str, int]) -> None:
    """Each model's processes' GPU memory (NVML) beside what the plan gave it."""
    rows = [({**labels, "model": name}, float(used.get(name, 0)), float(planned.get(name, 0)))
            for name in sorted(set(used) | set(planned))]  # fmt: skip
    with _lock:
        _processes[replica_id] = rows


def keep_gpus(gpus: Iterable[GpuReport]) -> None:
    """The host's GPUs as NVML read them this beat."""
    utilization = GaugeMetricFamily(
        "gantry_gpu_utilization_ratio", "GPU busy time over NVML's last sample period.", labels=["gpu", "uuid", "name"]
    )
    used = GaugeMetricFamily("gantry_gpu_memory_used_bytes", "GPU memory in use.", labels=["gpu", "uuid", "name"])
    total = GaugeMetricFamily("gantry_gpu_memory_total_bytes", "GPU memory in all.", labels=["gpu", "uuid", "name"])
    power = GaugeMetricFamily("gantry_gpu_power_watts", "GPU power draw.", labels=["gpu", "uuid", "name"])
    for gpu in gpus:
        labels = [str(gpu.index), gpu.uuid, gpu.name]
        utilization.add_metric(labels, gpu.utilization_percent / 100)
        used.add_metric(labels, gpu.memory_used_bytes)
        total.add_metric(labels, gpu.memory_total_bytes)
        power.add_metric(labels, gpu.power_watts)
    with _lock:
        _gpus[:] = [utilization, used, total, power]


def forget(keep: set[int]) -> None:
    """Drop replicas this host no longer serves (their figures would stand still)."""
    with _lock:
        for replica_id in set(_replicas) - keep:
            _replicas.pop(replica_id, None)
        for replica_id in set(_processes) - keep:
            _processes.pop(replica_id, None)


def triton_text() -> bytes:
    """Every replica's Triton families, each family's lines together (as the text format wants)."""
    with _lock:
        replicas = [families for families, _ok, _labels in _replicas.values()]
    merged: dict[str, tuple[list[str], list[str]]] = {}
    for families in replicas:
        for name, (header, samples) in families.items():
            into = merged.setdefault(name, (header, []))
            into[1].extend(samples)
    lines = [line for header, samples in merged.values() if samples for line in (*header, *samples)]
    return ("\n".join(lines) + "\n").encode() if lines else b""


def exposition(registry: object) -> bytes:
    """The host's whole /metrics: the worker's own and the structured figures, then Triton's."""
    return metrics.exposition(registry) + triton_text()


class Host(Collector):
    """What the agent kept, as of its last beat (Triton's own families: triton_text)."""

    def collect(self) -> Iterator[Metric]:
        with _lock:
            replicas = list(_replicas.values())
            gpus = list(_gpus)
            processes = [row for rows in _processes.values() for row in rows]
        up = GaugeMetricFamily(
            "gantry_replica_scrape_ok",
            "1 if the replica's Triton answered its last metrics scrape, else 0.",
            labels=["deployment", "replica", "replica_id"],
        )
        for _families, ok, labels in replicas:
            up.add_metric([labels["deployment"], labels["replica"], labels["replica_id"]], 1 if ok else 0)
        yield up
        yield from gpus
        names = ["deployment", "replica", "replica_id", "model"]
        used = GaugeMetricFamily(
            "gantry_model_gpu_memory_bytes", "GPU memory of a model's processes on a replica (NVML).", labels=names
        )
        planned = GaugeMetricFamily(
            "gantry_model_gpu_memory_planned_bytes", "GPU memory the plan gave a model on a replica.", labels=names
        )
        for labels, in_use, plan in processes:
            values = [labels[name] for name in names]
            used.add_metric(values, in_use)
            planned.add_metric(values, plan)
        yield used
        yield planned


class _Handler(BaseHTTPRequestHandler):
    registry = None

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?")[0] != "/metrics":
            self._answer(404, b"only /metrics is here\n", "text/plain")
        elif not metrics.scrape_allowed(self.headers.get("Authorization")):
            self._answer(401, metrics.REFUSED, "text/plain")
        else:
            self._answer(200, exposition(self.registry), metrics.CONTENT_TYPE)

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="metrics"')
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
        log.debug("metrics: " + format, *args)


def serve(address: str, port: int) -> ThreadingHTTPServer | None:
    """Serve /metrics on a daemon thread (None when metrics are off or the port is 0)."""
    if not metrics.enabled() or not port:
        return None
    handler = type("Handler", (_Handler,), {"registry": metrics.registry(Host())})
    try:
        server = ThreadingHTTPServer((address, port), handler)
    except OSError as exc:
        log.error("the worker's /metrics cannot listen on %s:%s: %s", address, port, exc)
        return None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="gantry-metrics", daemon=True).start()
    log.info("worker metrics on http://%s:%s/metrics", address, port)
    return server
