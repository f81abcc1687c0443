"""Triton's metrics exposition parsed and turned into rates."""

from __future__ import annotations

from triton_server.metrics import derive, in_flight, parse

EXPOSITION = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="minilm",version="1"} %(success)d
# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes
# TYPE nv_inference_request_failure counter
nv_inference_request_failure{model="minilm",reason="REJECTED",version="1"} 0
nv_inference_request_failure{model="minilm",reason="BACKEND",version="1"} %(failure)d
# HELP nv_inference_count Number of inferences performed (does not include cached requests)
# TYPE nv_inference_count counter
nv_inference_count{model="minilm",version="1"} %(success)d
# HELP nv_inference_request_duration_us Cumulative inference request duration in microseconds
# TYPE nv_inference_request_duration_us counter
nv_inference_request_duration_us{model="minilm",version="1"} %(request)d
# HELP nv_inference_queue_duration_us Cumulative inference queuing duration in microseconds
# TYPE nv_inference_queue_duration_us counter
nv_inference_queue_duration_us{model="minilm",version="1"} %(queue)d
# HELP nv_inference_compute_infer_duration_us Cumulative compute inference duration in microseconds
# TYPE nv_inference_compute_infer_duration_us counter
nv_inference_compute_infer_duration_us{model="minilm",version="1"} %(compute)d
# HELP nv_gpu_utilization GPU utilization rate [0.0 - 1.0)
# TYPE nv_gpu_utilization gauge
nv_gpu_utilization{gpu_uuid="GPU-1234"} 0.5
# HELP nv_gpu_memory_used_bytes GPU used memory, in bytes
# TYPE nv_gpu_memory_used_bytes gauge
nv_gpu_memory_used_bytes{gpu_uuid="GPU-1234"} 1000
"""


def _scrape(at, success, failure, queue, compute, request=0):
    figures = {"success": success, "failure": failure, "queue": queue, "compute": compute, "request": request}
    return parse(EXPOSITION % figures, at=at)


def test_parse_sums_failure_reasons_and_reads_gpu_gauges():
    scrape = _scrape(0, success=10, failure=3, queue=2000, compute=50000)
    counters = scrape.models["minilm"]
    assert (counters.success, counters.failure, counters.queue_us, counters.compute_us) == (10, 3, 2000, 50000)
    assert scrape.gpus == {"GPU-1234": {"utilization": 0.5, "memory_used_bytes": 1000}}


def test_derive_rates_and_mean_times_per_request():
    before = _scrape(100.0, success=10, failure=0, queue=1000, compute=20000, request=1_000_000)
    # 20 requests in 2 s that spent 6 s in the server together: 3 in it at a time on average.
    after = _scrape(102.0, success=30, failure=4, queue=5000, compute=60000, request=7_000_000)
    figures = derive(before, after)["minilm"]
    assert figures == {
        "requests_total": 30,
        "failures_total": 4,
        "pending": 0,
        "request_rate": 10.0,
        "failure_rate": 2.0,
        "queue_ms": 0.2,
        "compute_ms": 2.0,
        "concurrency": 3.0,
    }


def test_first_scrape_and_counter_reset_give_totals_only():
    first = _scrape(0, success=5, failure=0, queue=0, compute=0)
    assert derive(None, first)["minilm"] == {"requests_total": 5, "failures_total": 0, "pending": 0}
    restarted = _scrape(10, success=1, failure=0, queue=0, compute=0)
    assert "request_rate" not in derive(first, restarted)["minilm"]


HELD = """\
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="minilm",version="1"} 2
nv_inference_pending_request_count{model="llm",version="1"} 1
# TYPE gantry_requests_in_flight gauge
gantry_requests_in_flight{model="llm",model_instance="llm_0_0"} 5
gantry_requests_in_flight{model="llm",model_instance="llm_0_1"} 2
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="llm-engine",request_type="active",version="1"} %(active)d
nv_trt_llm_request_metrics{model="llm-engine",request_type="waiting",version="1"} 1
nv_trt_llm_request_metrics{model="llm-engine",request_type="max",version="1"} 256
"""


def test_in_flight_counts_triton_s_queue_and_what_generating_models_hold_once():
    # Queued 3; the python models hold 7; the engine behind a generate model counts the same
    # requests (active and waiting, never its max): the larger of the two is taken.
    assert in_flight(parse(HELD % {"active": 4})) == 3 + 7
    assert in_flight(parse(HELD % {"active": 9})) == 3 + 10
    assert in_flight(parse(EXPOSITION % {"success": 1, "failure": 0, "queue": 0, "compute": 0, "request": 0})) == 0
