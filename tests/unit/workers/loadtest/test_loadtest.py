"""What the worker gives AIPerf and reads back: the configuration for each
kind of model and target (the key only as a reference to the environment),
the figures and per-request records, and Triton's counters over a step."""

from __future__ import annotations

import json
from pathlib import Path

from loadtests.models import LoadTest
from triton_server import metrics
from workers.loadtest import aiperf, results, sampling


def _run(kind: str, **workload) -> LoadTest:  # noqa: ANN003
    base = {"mode": "concurrency", "levels": [1], "duration_s": None, "request_count": 10, "warmup_requests": 0,
            "endpoint": "chat", "streaming": True, "input_tokens": 32, "thresholds": {}, "direct": False,
            "seed": 3, "dataset": None, "output_tokens": 16, "batch_size": 4, "passages": 5}  # fmt: skip
    return LoadTest(pk=7, alias="org/chat", triton_name="tiny", kind=kind, workload={**base, **workload})


def _config(run: LoadTest, target: str = "gateway", level: float = 8) -> dict:
    step = aiperf.Step(target=target, level=level, index=0, total=1)
    return aiperf.config_for(run, step, gateway_url="http://gw:8000", triton_url="http://127.0.0.1:18000",
                               tokenizer="/models/tiny", artifacts=Path("/tmp/a"))["benchmark"]  # fmt: skip


def test_a_chat_step_goes_through_the_gateway_with_the_key_from_the_environment():
    config = _config(_run("llm", thresholds={"time_to_first_token_ms": 250}))
    endpoint = config["endpoint"]
    assert endpoint["url"] == "http://gw:8000" and endpoint["type"] == "chat" and endpoint["streaming"] is True
    assert endpoint["apiKey"] == "${GANTRY_LOADTEST_KEY}" and endpoint["useServerTokenCount"] is True
    assert config["model"] == "org/chat" and config["tokenizer"] == {"name": "/models/tiny"}
    assert config["phases"] == [{"name": "profiling", "type": "concurrency", "concurrency": 8, "requests": 10}]
    assert config["dataset"]["prompts"] == {"isl": 32, "osl": 16}
    assert config["slos"] == {"time_to_first_token": 250}


def test_a_direct_step_posts_the_ensemble_interface_to_triton_without_a_key():
    config = _config(_run("llm", streaming=False), target="triton")
    endpoint = config["endpoint"]
    assert endpoint["url"] == "http://127.0.0.1:18000" and endpoint["path"] == "/v2/models/tiny/generate_stream"
    assert "apiKey" not in endpoint and config["model"] == "tiny"
    body = endpoint["template"]["body"]
    assert '"text_input": {{ text|tojson }}' in body and '"stream": false' in body
    assert endpoint["template"]["responseField"] == "text_output"


def test_a_rate_step_of_fixed_duration_has_a_grace_period_and_a_warmup():
    config = _config(_run("llm", mode="rate", duration_s=30, request_count=None, warmup_requests=3), level=2.5)
    warmup, profiling = config["phases"]
    assert warmup["excludeFromResults"] and warmup["requests"] == 3
    assert profiling == {"name": "profiling", "type": "poisson", "rate": 2.5, "duration": 30,
                         "gracePeriod": aiperf.GRACE_S}  # fmt: skip


def test_embedder_and_reranker_steps_use_their_endpoints_and_synthetic_inputs():
    embed = _config(_run("embedding", streaming=False))
    assert embed["endpoint"]["type"] == "embeddings" and embed["dataset"]["prompts"] == {"isl": 32, "batchSize": 4}
    rerank = _config(_run("reranker", streaming=False))
    assert rerank["endpoint"]["type"] == "cohere_rankings" and rerank["endpoint"]["path"] == "/v1/rerank"
    assert rerank["dataset"]["rankings"] == {"passages": 5, "passageTokens": 32, "queryTokens": 16}


def test_an_uploaded_dataset_is_given_as_records_with_the_output_length():
    config = _config(_run("llm", dataset=["hello", "tell me a story"]))
    assert config["dataset"] == {"type": "file", "format": "single_turn", "records": [
        {"text": "hello", "output_length": 16}, {"text": "tell me a story", "output_length": 16}]}  # fmt: skip


def test_the_figures_and_records_are_read_from_what_aiperf_wrote(tmp_path: Path):
    export = {
        "request_throughput": {"unit": "requests/sec", "avg": 4.5},
        "goodput": {"unit": "requests/sec", "avg": 4.0},
        "request_latency": {"unit": "ms", "avg": 210.0, "p50": 200.0, "p90": 260.0, "p99": 300.0},
        "error_summary": [{"error_details": {"code": 429, "message": "slow down"}, "count": 2}],
        "was_cancelled": True,
    }
    summary = results.summary_of(export)
    assert summary["request_throughput"] == 4.5 and summary["goodput"] == 4.0
    assert summary["request_latency"]["p99"] == 300.0 and summary["was_cancelled"] is True
    assert summary["errors"] == [{"code": 429, "message": "slow down", "count": 2}]
    lines = [
        {"metadata": {"request_start_ns": 2_000_000}, "metrics": {"request_latency": {"value": 12.5},
         "time_to_first_token": {"value": 3.0}, "output_sequence_length": {"value": 8}}},
        {"metadata": {"request_start_ns": 1_000_000}, "metrics": {}, "error": {"code": 429, "type": "Too Many"}},
    ]  # fmt: skip
    path = tmp_path / "profile_export.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\nnot json\n")
    records, counted = results.records_of(path)
    assert counted == {"requests": 2, "errors": 1, "by_code": {"429": 1}}
    assert records[0] == {"latency_ms": 12.5, "ttft_ms": 3.0, "itl_ms": None, "input_tokens": None,
                          "output_tokens": 8, "error": None, "t_ms": 1.0}  # fmt: skip
    assert records[1]["error"] == "429 Too Many" and records[1]["t_ms"] == 0.0


def test_the_server_side_of_a_step_is_the_difference_of_tritons_counters():
    before = metrics.parse(
        'nv_inference_request_success{model="tiny",version="1"} 10\n'
        'nv_inference_queue_duration_us{model="tiny",version="1"} 1000\n'
        'nv_inference_compute_infer_duration_us{model="tiny",version="1"} 5000\n'
        'nv_gpu_utilization{gpu_uuid="GPU-1"} 0.5\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 4\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 100\n',
        at=1.0,
    )
    after = metrics.parse(
        'nv_inference_request_success{model="tiny",version="1"} 14\n'
        'nv_inference_queue_duration_us{model="tiny",version="1"} 5000\n'
        'nv_inference_compute_infer_duration_us{model="tiny",version="1"} 13000\n'
        'nv_gpu_utilization{gpu_uuid="GPU-1"} 0.9\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 30\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 100\n',
        at=5.0,
    )
    sampler = sampling.ServerSampler(url="unused", first=before, last=after, gauges=[before, after])
    summary = sampler.summary()
    assert summary["models"]["tiny"] == {"requests": 4.0, "failures": 0.0, "queue_ms": 1.0, "compute_ms": 2.0}
    assert summary["gpus"]["GPU-1"]["utilization_mean"] == 0.7 and summary["gpus"]["GPU-1"]["utilization_max"] == 0.9
    assert summary["kv_cache_blocks"] == {"used_max": 30.0, "max": 100.0, "free_min": 0.0}


def test_aiperfs_reason_is_read_out_of_its_exit_box():
    tail = [
        "│ • Service: record_processor_1                                    │",
        "│    Reason: Failed to load tokenizer '/models/x':                 │",
        "│            no tokenizer.json                                     │",
        "│    Cause: LifecycleOperationError                                │",
    ]
    from collections import deque

    assert aiperf.last_error(deque(tail)) == "Failed to load tokenizer '/models/x': no tokenizer.json"
