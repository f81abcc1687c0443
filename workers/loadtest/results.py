"""What AIPerf wrote: a step's summary figures and its per-request records."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# Per-request records kept per step (the figures cover every request).
MAX_RECORDS = 5000


# --- what AIPerf wrote ----------------------------------------------------------

# The figures kept from AIPerf's summary, by its metric names.
_DISTRIBUTIONS = (
    "request_latency",
    "time_to_first_token",
    "inter_token_latency",
    "output_token_throughput_per_user",
    "input_sequence_length",
    "output_sequence_length",
)
_TOTALS = (
    "request_throughput",
    "output_token_throughput",
    "total_token_throughput",
    "request_count",
    "error_request_count",
    "good_request_count",
    "goodput",
    "benchmark_duration",
)


def summary_of(export: dict[str, Any]) -> dict[str, Any]:
    """The step's figures from ``profile_export_aiperf.json``: totals, and p50/p90/p99
    and mean of each latency; goodput when thresholds were given; the errors."""
    summary: dict[str, Any] = {}
    for name in _TOTALS:
        if isinstance(export.get(name), dict) and export[name].get("avg") is not None:
            summary[name] = export[name]["avg"]
    for name in _DISTRIBUTIONS:
        metric = export.get(name)
        if isinstance(metric, dict) and metric.get("avg") is not None:
            summary[name] = {key: metric.get(key) for key in ("avg", "p50", "p90", "p99", "min", "max")}
            summary[name]["unit"] = metric.get("unit")
    summary["errors"] = [_error(entry) for entry in export.get("error_summary") or []]
    summary["was_cancelled"] = bool(export.get("was_cancelled"))
    return summary


def _error(entry: dict[str, Any]) -> dict[str, Any]:
    details = entry.get("error_details") or {}
    return {"code": details.get("code"), "message": str(details.get("message", ""))[:300], "count": entry.get("count")}


def records_of(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Compact per-request records from ``profile_export.jsonl`` (start offset,
    latency, first token, mean inter-token, tokens, error), and figures counted
    from them (requests, errors, by status code)."""
    rows: list[dict[str, Any]] = []
    counted = {"requests": 0, "errors": 0, "by_code": {}}
    if not path.exists():
        return rows, counted
    first: int | None = None
    with path.open() as handle:
        for line in handle:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            meta, values = entry.get("metadata") or {}, entry.get("metrics") or {}
            start = meta.get("request_start_ns")
            first = start if first is None else min(first, start or first)
            error = entry.get("error")
            counted["requests"] += 1
            if error:
                counted["errors"] += 1
                code = str(error.get("code"))
                counted["by_code"][code] = counted["by_code"].get(code, 0) + 1
            if len(rows) < MAX_RECORDS:
                rows.append(
                    {
                        "start_ns": start,
                        "latency_ms": _value(values, "request_latency"),
                        "ttft_ms": _value(values, "time_to_first_token"),
                        "itl_ms": _value(values, "inter_token_latency"),
                        "input_tokens": _value(values, "input_sequence_length"),
                        "output_tokens": _value(values, "output_sequence_length"),
                        "error": None if not error else f"{error.get('code')} {error.get('type', '')}".strip(),
                    }
                )
    for row in rows:
        start = row.pop("start_ns")
        row["t_ms"] = round((start - first) / 1e6, 3) if start is not None and first is not None else None
    return rows, counted


def _value(values: dict[str, Any], name: str) -> float | None:
    found = values.get(name)
    value = found.get("value") if isinstance(found, dict) else None
    return round(value, 3) if isinstance(value, (int, float)) and math.isfinite(value) else None
