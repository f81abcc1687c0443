"""The native ceiling of a load test: trtllm-bench on the same engine and the
same workload, with no server in between, so a run can show served/native.

This module writes trtllm-bench's dataset, checks the GPUs can hold a second
copy of the engine beside the running deployment, and reads the report it
writes; the command line is upstream.trtllm.compose_bench (per release,
like the builds'). It runs only where the host has TensorRT-LLM installed
(GANTRY_TRTLLM_PYTHON) at the version that built the engine: never on the
machines Gantry is developed and tested on, which have neither TensorRT-LLM
nor its images (tests/ put a stand-in trtllm-bench at that seam).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from workers.nvml import Inventory

# trtllm-bench loads the engine's weights again and needs room for activations
# and a KV cache beside them: refuse below this multiple of the weights free.
MEMORY_HEADROOM = 1.25
# trtllm-bench's KV cache takes this share of the memory left after its weights
# (its default is 0.9): the deployment's other models share the GPU and may grow.
KV_CACHE_FRACTION = 0.5


def write_dataset(path: Path, workload: dict[str, Any], *, vocab_size: int, entries: int) -> None:
    """``entries`` requests in trtllm-bench's JSON-lines format: the run's own
    prompts when it has a dataset (used in turn), else ``input_tokens`` random
    token ids each (seeded by the workload's seed); ``output_tokens`` each."""
    rng = random.Random(workload["seed"])
    prompts = workload.get("dataset") or []
    with path.open("w") as out:
        for task_id in range(entries):
            row: dict[str, Any] = {"task_id": task_id, "output_tokens": workload["output_tokens"]}
            if prompts:
                row["prompt"] = prompts[task_id % len(prompts)]
            else:
                row["input_ids"] = [rng.randrange(vocab_size) for _ in range(workload["input_tokens"])]
            out.write(json.dumps(row) + "\n")


def memory_refusal(inventory: Inventory, gpu_ids: list[int], engine_bytes: int, world_size: int) -> str:
    """Why the GPUs cannot hold trtllm-bench's copy of the engine now ('' if they can)."""
    need = engine_bytes / max(world_size, 1) * MEMORY_HEADROOM
    by_index = {gpu.index: gpu for gpu in inventory.gpus}
    short = []
    for index in gpu_ids:
        gpu = by_index.get(index)
        if gpu is None:
            short.append(f"GPU {index} is not on this host")
            continue
        free = gpu.memory_total_bytes - gpu.memory_used_bytes
        if free < need:
            short.append(f"GPU {index} has {free / 2**30:.1f} GiB free")
    if not short:
        return ""
    return (
        f"{'; '.join(short)}: trtllm-bench loads a second copy of the engine beside the running deployment and "
        f"needs {need / 2**30:.1f} GiB per GPU (the weights x {MEMORY_HEADROOM:g}); lower the deployment's KV-cache "
        "share or measure the ceiling on an idle GPU"
    )


def _distribution(values: dict[str, Any] | None) -> dict[str, Any] | None:
    if not isinstance(values, dict) or values.get("average") is None:
        return None
    picked = {"avg": values.get("average"), "min": values.get("minimum"), "max": values.get("maximum")}
    picked.update({key: values.get(key) for key in ("p50", "p90", "p99")})
    return {**picked, "unit": "ms"}


def summary_of(report: dict[str, Any]) -> dict[str, Any]:
    """The step's figures from trtllm-bench's ``--report_json``, under the same
    names AIPerf's summary uses (loadtests.selectors.COLUMNS), so a native step
    sits in the same table and curves as the served ones."""
    performance = report.get("performance") or {}
    streaming = report.get("streaming_metrics") or {}
    requests = (report.get("request_info") or {}).get("num_requests")
    summary: dict[str, Any] = {
        "request_throughput": performance.get("request_throughput_req_s"),
        "output_token_throughput": performance.get("system_output_throughput_tok_s"),
        "total_token_throughput": performance.get("system_total_throughput_tok_s"),
        "request_count": requests,
        "error_request_count": 0,
        "benchmark_duration": (performance.get("total_latency_ms") or 0) / 1000 or None,
    }
    per_user = performance.get("output_throughput_per_user_tok_s")
    if per_user is not None:
        summary["output_token_throughput_per_user"] = {"avg": per_user, "unit": "tokens/sec/user"}
    for name, values in (
        ("request_latency", performance.get("request_latency_percentiles_ms")),
        ("time_to_first_token", streaming.get("ttft_percentiles")),
        ("inter_token_latency", streaming.get("tpot_percentiles")),
    ):
        distribution = _distribution(values)
        if distribution is not None:
            summary[name] = distribution
    summary = {name: value for name, value in summary.items() if value is not None}
    summary["errors"] = []
    summary["was_cancelled"] = False
    summary["engine"] = {key: (report.get("engine") or {}).get(key) for key in ("version", "dtype", "quantization")}
    return summary
