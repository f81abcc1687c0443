"""What a load test may ask for, and the rules that need the model's kind.

Types and ranges are checked at the door (loadtests.api.WorkloadIn); this
module fills the defaults for the model's kind and refuses what does not fit
it, naming the field. The result is stored as the run's ``workload``.
"""

from __future__ import annotations

from typing import Any

from common.errors import ValidationFailed
from common.words import a
from deployments.models import ModelKind

MODES = ("concurrency", "rate")
LLM_ENDPOINTS = ("chat", "completions")
MAX_LEVELS = 8
MAX_CONCURRENCY = 256
MAX_RATE = 1000.0
MAX_DURATION_S = 600
MAX_REQUESTS = 5000
# A whole run (every level, every target) stays under this many seconds of load.
MAX_RUN_S = 1800
# An unknown duration (a request count) is bounded by this per step, then cut short.
STEP_LIMIT_S = MAX_DURATION_S
MAX_DATASET_ENTRIES = 5000
MAX_DATASET_ENTRY_CHARS = 20_000
THRESHOLDS = ("time_to_first_token_ms", "inter_token_latency_ms", "request_latency_ms")

_DEFAULT_INPUT_TOKENS = {ModelKind.LLM: 128, ModelKind.EMBEDDING: 32, ModelKind.RERANKER: 32}


def check(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The workload ``spec`` (types already checked) for a model of ``kind``,
    with defaults filled in; every broken rule at once, by field."""
    errors: dict[str, str] = {}
    if kind not in _DEFAULT_INPUT_TOKENS:
        raise ValidationFailed({"model": f"{a(kind)} model cannot be load tested (llm, embedding or reranker)"})
    llm = kind == ModelKind.LLM
    mode = spec.get("mode", "concurrency")
    levels = list(spec.get("levels") or [1])
    if mode == "concurrency":
        if any(level != int(level) or not 1 <= level <= MAX_CONCURRENCY for level in levels):
            errors["levels"] = f"concurrency levels are whole numbers from 1 to {MAX_CONCURRENCY}"
        levels = [int(level) for level in levels]
    elif any(not 0 < level <= MAX_RATE for level in levels):
        errors["levels"] = f"request rates are above 0 and at most {MAX_RATE:g} requests/s"
    if len(set(levels)) != len(levels):
        errors["levels"] = "each level once"
    duration_s, request_count = spec.get("duration_s"), spec.get("request_count")
    if (duration_s is None) == (request_count is None):
        errors["duration_s"] = "give a duration_s or a request_count (one of them)"
    direct = bool(spec.get("direct", False))
    if direct and not llm:
        errors["direct"] = "a direct run against Triton is for LLMs (the gateway's chat and completions)"
    native = bool(spec.get("native", False))
    if native and not llm:
        errors["native"] = "a native ceiling (trtllm-bench) is for TensorRT-LLM engines"
    elif native and mode != "concurrency":
        errors["native"] = "trtllm-bench holds a concurrency, not a request rate: use mode concurrency"
    elif native and request_count is None:
        errors["native"] = "trtllm-bench runs a request count, not a duration: give request_count"
    steps = len(levels) * (1 + direct + native)
    if duration_s is not None and duration_s * steps > MAX_RUN_S:
        errors["duration_s"] = f"{duration_s} s x {steps} steps is over the {MAX_RUN_S} s a run may load a deployment"
    streaming = spec.get("streaming", llm)
    if streaming and not llm:
        errors["streaming"] = "only an LLM streams"
    endpoint = spec.get("endpoint", "chat" if llm else kind)
    if llm and endpoint not in LLM_ENDPOINTS:
        errors["endpoint"] = f"one of {', '.join(LLM_ENDPOINTS)} for an LLM"
    elif not llm and endpoint != kind:
        errors["endpoint"] = f"{kind} for {a(kind)} model"
    for field, allowed in (("output_tokens", llm), ("batch_size", kind == ModelKind.EMBEDDING),
                           ("passages", kind == ModelKind.RERANKER)):  # fmt: skip
        if spec.get(field) is not None and not allowed:
            errors[field] = f"does not apply to {a(kind)} model"
    thresholds = dict(spec.get("thresholds") or {})
    for name in ("time_to_first_token_ms", "inter_token_latency_ms"):
        if name in thresholds and not streaming:
            errors[f"thresholds.{name}"] = "needs a streaming LLM run"
    dataset = spec.get("dataset")
    if dataset is not None and kind == ModelKind.RERANKER:
        errors["dataset"] = "a reranker run uses synthetic queries and passages"
    if errors:
        raise ValidationFailed(errors)
    workload = {
        "mode": mode,
        "levels": sorted(levels),
        "duration_s": duration_s,
        "request_count": request_count,
        "warmup_requests": spec.get("warmup_requests", 0),
        "endpoint": endpoint,
        "streaming": bool(streaming),
        "input_tokens": spec.get("input_tokens") or _DEFAULT_INPUT_TOKENS[kind],
        "thresholds": thresholds,
        "direct": direct,
        "native": native,
        "seed": spec.get("seed", 0),
        "dataset": dataset,
    }
    if llm:
        workload["output_tokens"] = spec.get("output_tokens") or 64
    if kind == ModelKind.EMBEDDING:
        workload["batch_size"] = spec.get("batch_size") or 1
    if kind == ModelKind.RERANKER:
        workload["passages"] = spec.get("passages") or 8
    return workload


def steps(workload: dict[str, Any]) -> list[tuple[str, float]]:
    """The (target, level) steps of a run, in the order they run: the served
    ones level by level, then the native ceiling's (trtllm-bench loads the
    engine again for each, so they run together after the served load)."""
    targets = ["gateway", "triton"] if workload["direct"] else ["gateway"]
    served = [(target, level) for level in workload["levels"] for target in targets]
    return served + [("native", level) for level in workload["levels"] if workload.get("native")]


_THRESHOLD_WORDS = {
    "time_to_first_token_ms": "time to first token",
    "inter_token_latency_ms": "inter-token latency",
    "request_latency_ms": "request latency",
}


def describe(workload: dict[str, Any]) -> str:
    """A stored workload in a person's words (a run's page shows it); what a
    workload lacks (one stored by an older release) is left out."""
    parts = []
    if workload.get("levels"):
        parts.append(f"{workload.get('mode', '')} {', '.join(str(level) for level in workload['levels'])}".strip())
    if workload.get("duration_s"):
        parts.append(f"{workload['duration_s']} s each")
    elif workload.get("request_count"):
        parts.append(f"{workload['request_count']} requests each")
    if workload.get("warmup_requests"):
        parts.append(f"{workload['warmup_requests']} warm-up requests")
    size = [f"{workload['input_tokens']} input tokens"] if workload.get("input_tokens") else []
    for key, words in (("output_tokens", "output tokens"), ("batch_size", "inputs per request"),
                       ("passages", "passages per query")):  # fmt: skip
        if workload.get(key):
            size.append(f"{workload[key]} {words}")
    if workload.get("streaming"):
        size.append("streamed")
    if size:
        parts.append(", ".join(size))
    route = "through the gateway"
    if workload.get("direct"):
        route += " and straight to Triton"
    if workload.get("native"):
        route += ", and the native ceiling (trtllm-bench)"
    parts.append(route)
    thresholds = workload.get("thresholds") or {}
    if thresholds:
        parts.append(
            "targets: "
            + ", ".join(f"{_THRESHOLD_WORDS.get(name, name)} ≤ {limit:g} ms" for name, limit in thresholds.items())
        )
    if "seed" in workload:
        parts.append(f"seed {workload['seed']}")
    return " · ".join(parts)
