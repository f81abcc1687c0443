"""Runs compared: figures per step side by side, and every setting that differs."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from common.errors import ValidationFailed
from loadtests import selectors, services
from loadtests.models import LoadTest

pytestmark = pytest.mark.django_db


def _run(*, levels: list[int], fraction: float, cache_key: str, throughput: float) -> LoadTest:
    run = LoadTest.objects.create(
        deployment_name="d", alias="chat", triton_name="tiny", kind="llm", status="succeeded",
        workload={"mode": "concurrency", "levels": levels, "dataset": ["a long prompt"] if fraction > 0.5 else None},
        context={"deployment": {"id": 1, "generation": 2}, "host": {"gpus": [{"uuid": "x"}]},
                 "placements": [{"triton_name": "tiny", "gpu_memory_fraction": fraction,
                                 "build": {"cache_key": cache_key}},
                                {"triton_name": "embed", "gpu_memory_fraction": 0.05, "build": None}]},
    )  # fmt: skip
    now = timezone.now()
    for level in levels:
        summary = {"request_throughput": throughput * level, "request_latency": {"p99": 10.0 * level}}
        services.point_save(
            run_id=run.pk, target="gateway", level=level, complete=True, records=[{"latency_ms": 1}],
            summary=summary, server={}, started_at=now, finished_at=now + dt.timedelta(seconds=5),
        )  # fmt: skip
    return run


def test_two_runs_show_their_steps_and_only_the_settings_that_differ():
    fp16 = _run(levels=[1, 8], fraction=0.8, cache_key="aaa", throughput=2.0)
    fp8 = _run(levels=[1, 8, 32], fraction=0.6, cache_key="bbb", throughput=3.0)
    compared = selectors.comparison([fp16.pk, fp8.pk])
    differences = {d["field"]: d["values"] for d in compared["differences"]}
    assert differences == {
        "workload.levels": [[1, 8], [1, 8, 32]],
        "context.placements.tiny.gpu_memory_fraction": [0.8, 0.6],
        "context.placements.tiny.build.cache_key": ["aaa", "bbb"],
    }
    second = compared["runs"][1]
    assert [p["level"] for p in second["points"]] == [1, 8, 32]
    assert second["points"][2]["figures"]["request_throughput"] == 96.0
    assert second["points"][2]["figures"]["request_latency.p99"] == 320.0
    assert second["points"][0]["figures"]["time_to_first_token.p50"] is None


def test_comparing_reads_a_fixed_number_of_queries_and_never_the_records():
    runs = [_run(levels=[1, 2, 4], fraction=0.8, cache_key=str(i), throughput=1.0) for i in range(4)]
    with CaptureQueriesContext(connection) as two:
        selectors.comparison([r.pk for r in runs[:2]])
    with CaptureQueriesContext(connection) as four:
        selectors.comparison([r.pk for r in runs])
    assert len(two) == len(four) == 2
    assert all("records" not in query["sql"].split("FROM")[0] for query in four.captured_queries)


def test_export_rows_flatten_each_step():
    run = _run(levels=[1, 8], fraction=0.8, cache_key="a", throughput=2.0)
    rows = selectors.export_rows([run.pk])
    assert [(r["run"], r["level"], r["request_throughput"]) for r in rows] == [(run.pk, 1, 2.0), (run.pk, 8, 16.0)]


@pytest.mark.parametrize("ids", [[1], list(range(1, 11)), [5, 5]])
def test_comparing_needs_two_to_eight_different_runs(ids):  # noqa: ANN001
    with pytest.raises(ValidationFailed):
        selectors.comparison(ids)
