"""Triton's side of a load-test step: its metrics sampled before, during and after."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from common.errors import TransientError
from triton_server import metrics

SAMPLE_EVERY_S = 2.0


# --- Triton's side of the step ---------------------------------------------------


@dataclass
class ServerSampler:
    """Triton's metrics over one step: counters at its start and end, gauges
    (GPU utilization and memory, TensorRT-LLM's KV-cache blocks) each sample."""

    url: str
    first: metrics.Scrape | None = None
    last: metrics.Scrape | None = None
    gauges: list[metrics.Scrape] = field(default_factory=list)
    next_at: float = 0.0

    def sample(self, *, force: bool = False) -> None:
        if not force and time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + SAMPLE_EVERY_S
        try:
            scrape = metrics.scrape(self.url)
        except TransientError:
            return
        self.first = self.first or scrape
        self.last = scrape
        self.gauges.append(scrape)

    def summary(self) -> dict[str, Any]:
        if self.first is None or self.last is None:
            return {"samples": 0}
        models = {}
        for name, end in self.last.models.items():
            start = self.first.models.get(name, metrics.ModelCounters())
            requests = end.success - start.success
            models[name] = {
                "requests": requests,
                "failures": end.failure - start.failure,
                "queue_ms": round((end.queue_us - start.queue_us) / requests / 1000, 3) if requests else None,
                "compute_ms": round((end.compute_us - start.compute_us) / requests / 1000, 3) if requests else None,
            }
        gpus: dict[str, dict[str, float]] = {}
        for uuid in self.last.gpus:
            seen = [s.gpus[uuid] for s in self.gauges if uuid in s.gpus]
            utilization = [g.get("utilization", 0.0) for g in seen]
            gpus[uuid] = {
                "utilization_mean": round(sum(utilization) / len(utilization), 4),
                "utilization_max": max(utilization),
                "memory_used_max_bytes": max(g.get("memory_used_bytes", 0.0) for g in seen),
                "memory_total_bytes": seen[-1].get("memory_total_bytes", 0.0),
            }
        found: dict[str, Any] = {"samples": len(self.gauges), "models": models, "gpus": gpus}
        kv = [s.kv_cache_blocks for s in self.gauges if s.kv_cache_blocks]
        if kv:
            found["kv_cache_blocks"] = {
                "used_max": max(k.get("used", 0.0) for k in kv),
                "max": kv[-1].get("max"),
                "free_min": min(k.get("free", 0.0) for k in kv),
            }
        return found
