"""Triton's Prometheus metrics (:8002/metrics), parsed with prometheus_client.

``scrape`` reads the cumulative counters per model and the GPU gauges;
``derive`` turns two scrapes into rates and mean times per request.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from common.errors import TransientError
from triton_server.names import placement_of
from triton_server.server import LOCAL

_MODEL_COUNTERS = {
    "nv_inference_request_success": "success",
    "nv_inference_request_failure": "failure",
    "nv_inference_count": "inferences",
    "nv_inference_request_duration_us": "request_us",
    "nv_inference_queue_duration_us": "queue_us",
    "nv_inference_compute_infer_duration_us": "compute_us",
    "nv_inference_pending_request_count": "pending",  # a gauge: requests Triton holds now
}
_KV_CACHE_BLOCKS = "nv_trt_llm_kv_cache_block_metrics"
# What Gantry's causal-LM python model reports of its slot KV cache (kind: used, capacity).
KV_CACHE_TOKENS = "gantry_kv_cache_tokens"
# Requests Gantry's generating python models hold (queued for a slot or generating): a
# decoupled model's request has left Triton's pending count once its execute() returned.
REQUESTS_IN_FLIGHT = "gantry_requests_in_flight"
# TensorRT-LLM's own count of the requests an engine holds, by request_type.
_ENGINE_REQUESTS = "nv_trt_llm_request_metrics"
_GPU_GAUGES = {
    "nv_gpu_utilization": "utilization",
    "nv_gpu_memory_used_bytes": "memory_used_bytes",
    "nv_gpu_memory_total_bytes": "memory_total_bytes",
}


@dataclass
class ModelCounters:
    success: float = 0.0
    failure: float = 0.0
    inferences: float = 0.0
    request_us: float = 0.0
    queue_us: float = 0.0
    compute_us: float = 0.0
    pending: float = 0.0


@dataclass
class Scrape:
    at: float
    models: dict[str, ModelCounters] = field(default_factory=dict)
    gpus: dict[str, dict[str, float]] = field(default_factory=dict)  # by GPU uuid
    # TensorRT-LLM's paged KV cache, summed over its models: max, free, used blocks (where present).
    kv_cache_blocks: dict[str, float] = field(default_factory=dict)
    # Per model, its KV cache's used and capacity: a python model's tokens (gantry_kv_cache_tokens),
    # or an engine's blocks (under the generate model in front of it).
    kv_cache_tokens: dict[str, dict[str, float]] = field(default_factory=dict)
    generating: float = 0.0  # gantry_requests_in_flight, summed over models
    engine_requests: float = 0.0  # TensorRT-LLM's active and waiting requests, summed over engines
    text: str = ""  # the exposition as read, for the host's re-export (workers.exporter)


def parse(text: str, *, at: float | None = None) -> Scrape:
    """Counters summed over versions (and failure reasons) per model; gauges per GPU."""
    result = Scrape(at=time.time() if at is None else at, text=text)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # prometheus_client strips a counter family's _total; samples keep their own names.
            name = sample.name.removesuffix("_total")
            if name in _MODEL_COUNTERS and "model" in sample.labels:
                counters = result.models.setdefault(sample.labels["model"], ModelCounters())
                attribute = _MODEL_COUNTERS[name]
                setattr(counters, attribute, getattr(counters, attribute) + sample.value)
            elif name in _GPU_GAUGES and "gpu_uuid" in sample.labels:
                result.gpus.setdefault(sample.labels["gpu_uuid"], {})[_GPU_GAUGES[name]] = sample.value
            elif name == _KV_CACHE_BLOCKS and sample.labels.get("kv_cache_block_type") in ("max", "free", "used"):
                kind = sample.labels["kv_cache_block_type"]
                result.kv_cache_blocks[kind] = result.kv_cache_blocks.get(kind, 0.0) + sample.value
                if kind != "free":  # the engine's use, shown on the generate model in front of it
                    found = result.kv_cache_tokens.setdefault(placement_of(sample.labels.get("model", "")), {})
                    key = "capacity" if kind == "max" else "used"
                    found[key] = found.get(key, 0.0) + sample.value
            elif name == REQUESTS_IN_FLIGHT:
                result.generating += sample.value
            elif name == _ENGINE_REQUESTS and sample.labels.get("request_type") in ("active", "waiting"):
                result.engine_requests += sample.value
            elif name == KV_CACHE_TOKENS and "model" in sample.labels and "kind" in sample.labels:
                found = result.kv_cache_tokens.setdefault(sample.labels["model"], {})  # summed over instances
                found[sample.labels["kind"]] = found.get(sample.labels["kind"], 0.0) + sample.value
    return result


def in_flight(scrape: Scrape) -> int:
    """The requests a server holds now: queued in Triton, and those a generating
    model took in (the engine behind a generate model counts the same requests:
    the larger of the two is taken, not their sum)."""
    queued = sum(counters.pending for counters in scrape.models.values())
    return round(queued + max(scrape.generating, scrape.engine_requests))


def local_url(port: int) -> str:
    """The metrics URL of a server on this host listening on ``port``."""
    return f"http://{LOCAL}:{port}/metrics"


def scrape(url: str, *, timeout_s: float = 5.0) -> Scrape:
    """Read and parse ``url`` (http://host:metrics_port/metrics)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - http URL built by Gantry
            text = response.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        raise TransientError(f"metrics unreachable at {url}: {exc}") from exc
    try:
        return parse(text)
    except ValueError as exc:
        raise TransientError(f"metrics at {url} are not in the Prometheus text format: {exc}") from exc


def derive(previous: Scrape | None, current: Scrape) -> dict[str, dict[str, float]]:
    """Per model: totals, and since ``previous`` the request and failure rates
    (per second), the mean queue and compute time per request (ms), and the
    mean concurrency (requests in the server, queued or executing: the time
    its requests spent there per second of the interval, by Little's law)."""
    derived: dict[str, dict[str, float]] = {}
    elapsed = current.at - previous.at if previous is not None else 0.0
    for model, now in current.models.items():
        values = {"requests_total": now.success, "failures_total": now.failure, "pending": now.pending}
        before = previous.models.get(model) if previous is not None else None
        if before is not None and elapsed > 0 and now.success >= before.success:
            requests = now.success - before.success
            values["request_rate"] = requests / elapsed
            values["failure_rate"] = max(0.0, now.failure - before.failure) / elapsed
            values["queue_ms"] = (now.queue_us - before.queue_us) / requests / 1000 if requests else 0.0
            values["compute_ms"] = (now.compute_us - before.compute_us) / requests / 1000 if requests else 0.0
            values["concurrency"] = max(0.0, now.request_us - before.request_us) / 1e6 / elapsed
        tokens = current.kv_cache_tokens.get(model, {})
        if tokens.get("capacity"):
            values["kv_cache_used_fraction"] = tokens.get("used", 0.0) / tokens["capacity"]
        derived[model] = {key: round(value, 4) for key, value in values.items()}
    return derived
