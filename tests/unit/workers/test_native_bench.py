"""The native ceiling's files: the dataset trtllm-bench reads, the GPU memory
it needs beside a running deployment, and the report it writes, read into the
same figures as AIPerf's."""

from __future__ import annotations

import json
from pathlib import Path

from hosts.services.hosts import GpuReport
from upstream import trtllm
from workers import native_bench
from workers.engines.executors import NativeExecutor
from workers.nvml import Inventory

WORKLOAD = {"seed": 5, "input_tokens": 12, "output_tokens": 7, "dataset": None}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_synthetic_requests_are_seeded_token_ids_within_the_vocabulary(tmp_path: Path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    native_bench.write_dataset(first, WORKLOAD, vocab_size=50, entries=6)
    native_bench.write_dataset(second, WORKLOAD, vocab_size=50, entries=6)
    rows = _rows(first)
    assert [row["task_id"] for row in rows] == list(range(6)) and first.read_text() == second.read_text()
    assert all(len(row["input_ids"]) == 12 and max(row["input_ids"]) < 50 and row["output_tokens"] == 7 for row in rows)
    assert len({tuple(row["input_ids"]) for row in rows}) == 6


def test_a_runs_own_prompts_are_used_in_turn(tmp_path: Path):
    path = tmp_path / "d.jsonl"
    native_bench.write_dataset(path, {**WORKLOAD, "dataset": ["one", "two"]}, vocab_size=50, entries=3)
    assert [(row["prompt"], row["output_tokens"]) for row in _rows(path)] == [("one", 7), ("two", 7), ("one", 7)]
    assert "input_ids" not in _rows(path)[0]


def _gpu(index: int, used_gib: float) -> GpuReport:
    return GpuReport(index=index, uuid=f"GPU-{index}", name="H100", compute_capability="9.0",
                     memory_total_bytes=80 << 30, memory_used_bytes=int(used_gib * 2**30))  # fmt: skip


def test_the_gpus_must_hold_a_second_copy_of_the_engine_beside_the_deployment():
    inventory = Inventory(gpus=[_gpu(0, 70), _gpu(1, 10)])
    engine = 10 << 30
    assert native_bench.memory_refusal(inventory, [1], engine, world_size=1) == ""
    refusal = native_bench.memory_refusal(inventory, [0, 1], engine, world_size=1)
    assert refusal.startswith("GPU 0 has 10.0 GiB free: trtllm-bench loads a second copy")
    assert "needs 12.5 GiB per GPU" in refusal
    # Split over two ranks, each GPU holds half of the engine.
    assert "needs 12.5 GiB per GPU" in native_bench.memory_refusal(inventory, [0, 1], 2 * engine, world_size=2)
    assert "GPU 3 is not on this host" in native_bench.memory_refusal(inventory, [3], engine, world_size=1)


def test_the_report_is_read_into_the_figures_a_served_step_has():
    percentiles = {"p50": 20.0, "p90": 30.0, "p95": 31.0, "p99": 40.0, "minimum": 10.0, "maximum": 41.0,
                   "average": 22.0}  # fmt: skip
    report = {
        "engine": {"model": "llama", "version": "0.20.0", "dtype": "float16", "quantization": "FP8"},
        "request_info": {"num_requests": 200},
        "performance": {"total_latency_ms": 4000.0, "request_throughput_req_s": 50.0,
                        "system_output_throughput_tok_s": 6400.0, "system_total_throughput_tok_s": 12800.0,
                        "output_throughput_per_user_tok_s": 800.0, "request_latency_percentiles_ms": percentiles},
        "streaming_metrics": {"ttft_percentiles": percentiles, "tpot_percentiles": {**percentiles, "p99": 4.0}},
    }  # fmt: skip
    summary = native_bench.summary_of(report)
    assert summary["request_throughput"] == 50.0 and summary["output_token_throughput"] == 6400.0
    assert summary["request_count"] == 200 and summary["benchmark_duration"] == 4.0
    assert summary["request_latency"] == {"avg": 22.0, "min": 10.0, "max": 41.0, "p50": 20.0, "p90": 30.0,
                                          "p99": 40.0, "unit": "ms"}  # fmt: skip
    assert summary["time_to_first_token"]["p99"] == 40.0 and summary["inter_token_latency"]["p99"] == 4.0
    assert summary["output_token_throughput_per_user"]["avg"] == 800.0
    assert summary["engine"] == {"version": "0.20.0", "dtype": "float16", "quantization": "FP8"}
    # Not streamed: no first-token figures are made up.
    del report["streaming_metrics"]
    assert "time_to_first_token" not in native_bench.summary_of(report)


def test_a_host_python_runs_the_trtllm_bench_installed_beside_it(settings):  # noqa: ANN001
    settings.GANTRY_TRTLLM_PYTHON = "/opt/trt/bin/python3"
    tools = NativeExecutor().toolchain(trtllm.RELEASES["0.20.0"])
    assert tools.trtllm_bench == ["/opt/trt/bin/trtllm-bench"]
