"""Load tests end to end: AIPerf (its own environment, as make test installs
it) on a real worker, through the real gateway and straight to a real
tritonserver serving an untrained checkpoint of a real architecture and the
packaged MiniLM. Started from the API and from the browser, compared and
exported; cancelled midway; the worker SIGKILLed under a run; and a deployment
stopped under a run."""

from __future__ import annotations

import csv
import datetime as dt
import io
import os
import signal
import time
from pathlib import Path

import pytest

from tests.integration.conftest import Stack, wait_for
from tests.integration.test_browser import _sign_in
from tests.integration.test_gateway import _alias, _deploy, _key
from workers import processes

# The beat revokes a run's gateway key once the run ended, and reaps runs whose worker went away.
pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True), pytest.mark.control_beat]

ENDED = ("succeeded", "failed", "cancelled")


def _start(stack: Stack, deployment: dict, model: str, workload: dict, **fields) -> dict:  # noqa: ANN003
    body = {"deployment": deployment["id"], "model": model, "workload": workload, "confirm": True, **fields}
    response = stack.session().post(f"{stack.web_url}/api/loadtests/", json=body, timeout=30)
    assert response.status_code == 201, response.text
    return response.json()


def _run(stack: Stack, run_id: int) -> dict:
    return stack.session().get(f"{stack.web_url}/api/loadtests/{run_id}/", timeout=10).json()


def _ended(stack: Stack, run_id: int, timeout_s: float = 300) -> dict:
    return wait_for(lambda: (r := _run(stack, run_id))["status"] in ENDED and r, timeout_s, f"load test {run_id}")


def _keys(stack: Stack) -> dict[str, dict]:
    listed = stack.session().get(f"{stack.web_url}/api/gateway/keys/?limit=500", timeout=10).json()["results"]
    return {k["name"]: k for k in listed}


def _under_load(stack: Stack, run_id: int, deployment: dict, model: str) -> dict:
    """The run once Triton has served its load for a while (AIPerf takes seconds to
    start, longer on a busy machine): a few metric samples since it began with
    requests of ``model``."""
    run = wait_for(lambda: (r := _run(stack, run_id))["status"] == "running" and r, 180, f"load test {run_id} running")
    metrics = f"{stack.web_url}/api/deployments/{deployment['id']}/metrics/?kind=model&ordering=-id&limit=50"

    def loaded() -> bool:
        samples = stack.session().get(metrics, timeout=10).json()["results"]
        began = dt.datetime.fromisoformat(run["started_at"])
        busy = [s for s in samples if s["subject"] == model and dt.datetime.fromisoformat(s["at"]) > began
                and (s["values"].get("request_rate") or 0) > 0]  # fmt: skip
        return len(busy) >= 3

    wait_for(loaded, 180, f"Triton serving load test {run_id}", interval_s=1)
    return _run(stack, run_id)


def test_load_tests_measure_through_the_gateway_and_triton_and_compare(
    stack: Stack,
    tiny_llm: Path,
    minilm_path: Path,
    page,
    screenshot,  # noqa: ANN001
):
    stack.register_models(tiny_llm, tiny="llm")
    stack.register_models(minilm_path, minilm="embedding")
    deployment = _deploy(stack, "bench", [{"model": "tiny", "max_batch_size": 8, "max_queue_delay_us": 500},
                                          {"model": "minilm"}])  # fmt: skip
    _alias(stack, "chat", deployment, "tiny")
    _alias(stack, "embedder", deployment, "minilm")
    _key(stack, name="production app", all_aliases=True)
    http = stack.session()
    url = f"{stack.web_url}/api/loadtests/"

    # Real clients use the deployment: the run asks for a confirmation first; bad specs are refused by field.
    workload = {"levels": [1, 2], "request_count": 6, "input_tokens": 16, "output_tokens": 8, "direct": True,
                "thresholds": {"time_to_first_token_ms": 60_000}}  # fmt: skip
    refused = http.post(url, json={"deployment": deployment["id"], "model": "chat", "workload": workload}, timeout=30)
    assert refused.status_code == 409 and refused.json()["code"] == "confirmation_required", refused.text
    assert "production app" in refused.json()["detail"]
    for bad, field in (
        ({"levels": [1], "request_count": 5, "batch_size": 2}, "workload.batch_size"),
        ({"levels": [0.5], "request_count": 5}, "workload.levels"),
        ({"levels": [1]}, "workload.duration_s"),
        ({"levels": [1], "request_count": 99999}, "workload.request_count"),
        ({"levels": [1], "request_count": 5, "bogus": 1}, "workload.bogus"),
    ):
        answer = http.post(url, json={"deployment": deployment["id"], "model": "chat", "workload": bad,
                                      "confirm": True}, timeout=30)  # fmt: skip
        assert answer.status_code == 400, answer.text
        assert field in answer.json()["errors"], (field, answer.json())
    assert http.get(url, timeout=10).json()["results"] == []

    # Streaming chat at concurrency 1 and 2, through the gateway and straight to Triton.
    chat = _start(stack, deployment, "chat", workload)
    busy = http.post(url, json={"deployment": deployment["id"], "model": "embedder", "confirm": True,
                                "workload": {"request_count": 3}}, timeout=30)  # fmt: skip
    assert busy.status_code == 409 and "one run at a time" in busy.json()["detail"]
    chat = _ended(stack, chat["id"])
    assert chat["status"] == "succeeded", (chat["status_message"], chat["log_tail"][-2000:])
    assert chat["context"]["load_generator"]["name"] == "aiperf"
    assert chat["context"]["deployment"]["generation"] == 1
    assert {p["triton_name"] for p in chat["context"]["placements"]} == {"tiny", "minilm"}
    steps = {(p["target"], p["level"]): p for p in chat["points"]}
    assert set(steps) == {("gateway", 1), ("gateway", 2), ("triton", 1), ("triton", 2)}
    for point in steps.values():
        summary = point["summary"]
        assert point["complete"] and summary["counted"] == {"requests": 6, "errors": 0, "by_code": {}}, point
        assert summary["request_throughput"] > 0 and summary["output_token_throughput"] > 0
        assert 0 < summary["time_to_first_token"]["p50"] <= summary["request_latency"]["p99"]
        assert summary["goodput"] == pytest.approx(summary["request_throughput"])  # every request met 60 s
        # Triton counted the step's requests for the model under test.
        assert point["server"]["models"]["tiny"]["requests"] >= 6, point["server"]
    records = http.get(f"{url}{chat['id']}/records/?level=2&target=triton", timeout=10).json()["records"]
    assert len(records) == 6 and all(r["latency_ms"] > 0 and r["error"] is None for r in records)
    # The run's own gateway key is revoked by the beat once the run ended; the production key is untouched.
    own_name = f"load test {chat['id']}"
    own = wait_for(lambda: (k := _keys(stack)[own_name])["revoked_at"] and k, 30, "the key's revocation")
    keys = _keys(stack)
    assert own["revoked_at"] is not None and own["last_used_at"] is not None and own["aliases"] == ["chat"]
    assert keys["production app"]["revoked_at"] is None

    # Embeddings, started from the deployment's page: the confirmation, then the run's page follows it live.
    _sign_in(page, stack, f"/deployments/{deployment['id']}/")
    page.click("#tab-testing")
    page.wait_for_selector(f"#loadtest-runs [data-run='{chat['id']}']")
    page.click("#loadtest-new summary")
    page.select_option("#loadtest-form select[name=model]", "embedder")
    page.fill("input[name='workload.levels']", "1")
    page.fill("input[name=bound_value]", "12")
    page.fill("input[name='workload.batch_size']", "4")
    page.click("#loadtest-form button[type=submit]")
    page.wait_for_selector("[data-loadtest-note]:not([hidden])")
    assert "production app" in page.inner_text("[data-loadtest-note]")
    screenshot("loadtest-confirm")
    page.click("[data-confirm]")
    page.wait_for_url("**/loadtests/*/")
    page.wait_for_function("document.querySelector('#loadtest [data-status]').textContent === 'succeeded'",
                           timeout=240_000)  # fmt: skip
    page.wait_for_selector("#figures tbody tr td.number")
    embed_id = int(page.url.rstrip("/").rsplit("/", 1)[1])
    screenshot("loadtest-run")
    embed = _run(stack, embed_id)
    assert embed["workload"]["batch_size"] == 4 and embed["kind"] == "embedding"
    assert embed["points"][0]["summary"]["counted"]["requests"] == 12

    # Compared side by side: figures per step, curves, and what differs; exported.
    compared = http.get(f"{url}compare/?ids={chat['id']},{embed_id}", timeout=10).json()
    fields = {d["field"] for d in compared["differences"]}
    assert {"workload.endpoint", "workload.levels", "workload.direct"} <= fields
    assert "context.deployment.generation" not in fields  # the same generation
    exported = http.get(f"{url}export/?ids={chat['id']},{embed_id}&file=csv", timeout=10)
    rows = list(csv.DictReader(io.StringIO(exported.text)))
    assert len(rows) == 5 and {r["target"] for r in rows} == {"gateway", "triton"}
    assert all(float(r["request_throughput"]) > 0 for r in rows)
    page.goto(f"{stack.web_url}/loadtests/compare/?ids={chat['id']},{embed_id}")
    page.wait_for_selector("#curves .uplot")
    assert "workload.endpoint" in page.inner_text("#differences")
    screenshot("loadtest-compare")

    # Cancelled midway: the run ends cancelled, keeping what the cut step measured.
    long = _start(stack, deployment, "chat", {"levels": [1, 2], "duration_s": 60, "output_tokens": 8})
    _under_load(stack, long["id"], deployment, "tiny")
    cancelled = http.post(f"{url}{long['id']}/cancel/", timeout=10)
    assert cancelled.status_code == 202 and cancelled.json()["status"] == "cancelling"
    began = time.monotonic()
    long = _ended(stack, long["id"], 90)
    assert long["status"] == "cancelled" and time.monotonic() - began < 60, long["status_message"]
    assert [(p["target"], p["level"], p["complete"]) for p in long["points"]] == [("gateway", 1, False)]
    assert long["points"][0]["summary"]["counted"]["requests"] > 0

    # The host's worker SIGKILLed under a run: AIPerf has a process group of its own and outlives it;
    # the next worker stops it and fails the run; the beat revokes the run's key.
    orphan = _start(stack, deployment, "chat", {"levels": [1], "duration_s": 60, "output_tokens": 8})
    aiperf = _under_load(stack, orphan["id"], deployment, "tiny")["progress"]["pid"]
    os.killpg(stack.worker.pid, signal.SIGKILL)
    stack.worker.wait()
    assert processes.is_alive(aiperf)
    stack.start_worker()
    orphan = _ended(stack, orphan["id"], 120)
    assert orphan["status"] == "failed" and "stopped (killed or restarted)" in orphan["status_message"], orphan
    wait_for(lambda: not processes.is_alive(aiperf), 30, "the orphaned AIPerf to stop")
    wait_for(lambda: _keys(stack)[f"load test {orphan['id']}"]["revoked_at"], 30, "the orphan's key's revocation")

    # The deployment stopped under a run: the run fails with the reason and keeps what it measured.
    doomed = _start(stack, deployment, "embedder", {"levels": [1], "duration_s": 60})
    _under_load(stack, doomed["id"], deployment, "minilm")
    assert http.post(f"{stack.web_url}/api/deployments/{deployment['id']}/stop/", timeout=30).status_code == 202
    doomed = _ended(stack, doomed["id"], 120)
    assert doomed["status"] == "failed" and "left ready" in doomed["status_message"], doomed["status_message"]
    assert doomed["points"] and doomed["points"][0]["complete"] is False
    timeline = http.get(f"{stack.web_url}/api/deployments/{deployment['id']}/events/?limit=200", timeout=10).json()
    kinds = [e["kind"] for e in timeline["results"]]
    assert {
        "loadtest.queued",
        "loadtest.running",
        "loadtest.succeeded",
        "loadtest.cancelled",
        "loadtest.failed",
    } <= set(kinds)
