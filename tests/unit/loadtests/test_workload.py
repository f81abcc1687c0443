"""The workload rules that need the model's kind, each refusal naming its field."""

from __future__ import annotations

import pytest

from common.errors import ValidationFailed
from loadtests import workload


def _refused(kind: str, spec: dict) -> dict[str, list[str]]:
    with pytest.raises(ValidationFailed) as refused:
        workload.check(kind, spec)
    return refused.value.errors


def test_an_llm_workload_gets_the_defaults_of_its_kind():
    checked = workload.check("llm", {"levels": [8, 1], "request_count": 20})
    assert checked["levels"] == [1, 8] and checked["streaming"] is True and checked["endpoint"] == "chat"
    assert checked["output_tokens"] == 64 and checked["input_tokens"] == 128 and checked["direct"] is False
    assert workload.steps(checked) == [("gateway", 1), ("gateway", 8)]


def test_a_direct_run_measures_each_level_through_the_gateway_and_straight_to_triton():
    checked = workload.check("llm", {"levels": [1, 4], "duration_s": 10, "direct": True})
    assert workload.steps(checked) == [("gateway", 1), ("triton", 1), ("gateway", 4), ("triton", 4)]


def test_a_native_ceiling_runs_after_the_served_steps_at_the_same_levels():
    checked = workload.check("llm", {"levels": [4, 1], "request_count": 50, "direct": True, "native": True})
    assert checked["native"] is True
    assert workload.steps(checked) == [("gateway", 1), ("triton", 1), ("gateway", 4), ("triton", 4),
                                       ("native", 1), ("native", 4)]  # fmt: skip


def test_an_embedder_workload_does_not_stream_and_batches_sentences():
    checked = workload.check("embedding", {"request_count": 5, "batch_size": 16})
    assert checked["streaming"] is False and checked["batch_size"] == 16 and checked["endpoint"] == "embedding"
    assert "output_tokens" not in checked


@pytest.mark.parametrize(
    ("kind", "spec", "field"),
    [
        ("llm", {"levels": [1]}, "duration_s"),
        ("llm", {"levels": [1], "duration_s": 10, "request_count": 5}, "duration_s"),
        ("llm", {"levels": [1.5], "request_count": 5}, "levels"),
        ("llm", {"levels": [300], "request_count": 5}, "levels"),
        ("llm", {"levels": [2, 2], "request_count": 5}, "levels"),
        ("llm", {"levels": [1, 2, 4, 8], "duration_s": 600}, "duration_s"),
        ("llm", {"request_count": 5, "endpoint": "embedding"}, "endpoint"),
        ("llm", {"request_count": 5, "batch_size": 4}, "batch_size"),
        ("llm", {"request_count": 5, "streaming": False, "thresholds": {"time_to_first_token_ms": 100}},
         "thresholds.time_to_first_token_ms"),
        ("embedding", {"request_count": 5, "streaming": True}, "streaming"),
        ("embedding", {"request_count": 5, "direct": True}, "direct"),
        ("embedding", {"request_count": 5, "output_tokens": 5}, "output_tokens"),
        ("reranker", {"request_count": 5, "dataset": ["a"]}, "dataset"),
        ("reranker", {"request_count": 5, "batch_size": 2}, "batch_size"),
        ("llm", {"mode": "rate", "levels": [2000], "request_count": 5}, "levels"),
        ("embedding", {"request_count": 5, "native": True}, "native"),
        ("llm", {"mode": "rate", "levels": [2], "request_count": 5, "native": True}, "native"),
        ("llm", {"levels": [2], "duration_s": 10, "native": True}, "native"),
    ],
)  # fmt: skip
def test_a_workload_that_does_not_fit_the_model_is_refused_by_field(kind, spec, field):  # noqa: ANN001
    assert field in _refused(kind, spec)


def test_a_custom_model_cannot_be_load_tested():
    assert "model" in _refused("custom", {"request_count": 1})


def test_request_rates_may_be_fractions():
    checked = workload.check("llm", {"mode": "rate", "levels": [0.5, 2], "duration_s": 30})
    assert checked["levels"] == [0.5, 2]


def test_a_workload_is_described_in_words_not_python():
    described = workload.describe(
        {"mode": "concurrency", "levels": [1, 4], "duration_s": 10, "request_count": None, "warmup_requests": 0,
         "input_tokens": 128, "output_tokens": 64, "streaming": True, "direct": True, "native": False,
         "thresholds": {"time_to_first_token_ms": 500.0}, "seed": 0, "dataset": None}
    )  # fmt: skip
    assert described == (
        "concurrency 1, 4 · 10 s each · 128 input tokens, 64 output tokens, streamed · through the gateway and "
        "straight to Triton · targets: time to first token ≤ 500 ms · seed 0"
    )
    assert "=" not in described and "{" not in described
