"""Tuning runs end to end: the packaged MiniLM as embedder and as reranker on
a real worker, tritonserver and gateway, tuned over a small space (the
embedder's preferred batch sizes, the reranker's instance count) under a mix
of both aliases at once, each with AIPerf at its rate. Started from the
deployment's page and followed there; refused by field; asked to end on its
winner, it does so in one roll-out; cancelled midway with the starting
settings back, and after its worker was killed. How much the winner gains is
a measured figure, printed by bench/tuning.py, never asserted here: a fresh
load test on CI's two shared cores measures the core's load as much as the
plan. (No LLM: the mix loads none, and every trial is a roll-out that would
load it again.)"""

from __future__ import annotations

import csv
import io
import json
import os
import signal
from pathlib import Path

import pytest

from tests.integration.conftest import Stack, wait_for
from tests.integration.test_browser import _sign_in
from tests.integration.test_gateway import _alias, _deploy, _key

# As in production, the beat runs beside the host: it redrives a trial's roll whose message
# was lost, reaps a run whose worker went away and revokes the run's gateway key.
pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True), pytest.mark.control_beat]

ENDED = ("succeeded", "failed", "cancelled")
# The embedder starts badly: a request waits up to a second for a batch of 8 that
# two requests per second never fill, so few meet an 800 ms target; a batch of 1
# is sent at once. The margin is wide because CI's two cores are shared with
# another test file: a loaded core turns milliseconds into hundreds, and the run
# ends on its winner only where that met every target. The ranker's load is light
# and its target loose, so the embedder decides the best plan.
EMBED_TARGET_MS = 800.0
MIX = [
    {"model": "embedder", "rate": 2.0, "targets": {"request_latency_ms": EMBED_TARGET_MS}},
    {"model": "ranker", "rate": 0.5, "passages": 2, "targets": {"request_latency_ms": 5000.0}},
]
SPACE = {"minilm": {"preferred_batch_sizes": [[8], [1]]}, "minirank": {"instance_count": [1, 2]}}


def _tuning(stack: Stack, run_id: int) -> dict:
    return stack.session().get(f"{stack.web_url}/api/tuning/{run_id}/", timeout=10).json()


def _tuned(stack: Stack, run_id: int, timeout_s: float) -> dict:
    return wait_for(lambda: (r := _tuning(stack, run_id))["status"] in ENDED and r, timeout_s, f"tuning run {run_id}")


def _settled(stack: Stack, deployment: dict, generation: int) -> dict:
    """The deployment once every replica serves ``generation`` or later."""
    url = f"{stack.web_url}/api/deployments/{deployment['id']}/"

    def ready() -> dict | None:
        current = stack.session().get(url, timeout=10).json()
        return current if current["status"] == "ready" and current["generation"] >= generation else None

    return wait_for(ready, 240, f"{deployment['name']} at generation {generation}", interval_s=0.5)


def _placements(stack: Stack, deployment: dict) -> dict:
    current = stack.session().get(f"{stack.web_url}/api/deployments/{deployment['id']}/", timeout=10).json()
    return {m["triton_name"]: (m["preferred_batch_sizes"], m["instance_count"]) for m in current["models"]}


def test_a_tuning_run_finds_a_plan_that_beats_the_starting_one(
    stack: Stack,
    minilm_path: Path,
    page,
    screenshot,  # noqa: ANN001
):
    stack.register_models(minilm_path, minilm="embedding", minirank="reranker")
    deployment = _deploy(stack, "tuned", [
        {"model": "minilm", "max_batch_size": 8, "preferred_batch_sizes": [8], "max_queue_delay_us": 1_000_000},
        {"model": "minirank", "max_batch_size": 8},
    ])  # fmt: skip
    _alias(stack, "embedder", deployment, "minilm")
    _alias(stack, "ranker", deployment, "minirank")
    _key(stack, name="production app", all_aliases=True)
    start = _placements(stack, deployment)
    http = stack.session()
    url = f"{stack.web_url}/api/tuning/"
    spec = {"deployment": deployment["id"], "mix": MIX, "space": SPACE, "trial_s": 10, "budget_s": 900}

    # Refused by field: what does not fit the deployment, and real clients unconfirmed.
    bad = {**spec, "mix": [{"model": "embedder", "rate": 1.0, "targets": {"time_to_first_token_ms": 5.0}}],
           "space": {"minilm": {"dtype": ["float32", "float16"]}, "ghost": {"instance_count": [1, 2]}}}  # fmt: skip
    refused = http.post(url, json={**bad, "confirm": True}, timeout=30)
    assert refused.status_code == 400, refused.text
    assert {"mix[0].targets.time_to_first_token_ms", "space.minilm.dtype", "space.ghost"} <= set(
        refused.json()["errors"]
    ), refused.json()
    unconfirmed = http.post(url, json=spec, timeout=30)
    assert unconfirmed.status_code == 409 and unconfirmed.json()["code"] == "confirmation_required"

    # Started from the deployment's page, followed on the run's page.
    _sign_in(page, stack, f"/deployments/{deployment['id']}/")
    page.click("#tab-testing")
    page.click("#tuning-new summary")
    page.wait_for_function("document.querySelector('#tuning-form textarea[name=mix]').value.includes('embedder')")
    page.fill("#tuning-form textarea[name=mix]", "not json")
    page.click("#tuning-form button[type=submit]")
    page.wait_for_selector("#tuning-form [data-error-for=mix]:has-text('not JSON')")
    screenshot("tuning-form")
    page.fill("#tuning-form textarea[name=mix]", json.dumps(MIX))
    page.fill("#tuning-form textarea[name=space]", json.dumps(SPACE))
    page.fill("#tuning-form input[name=trial_s]", "10")
    page.fill("#tuning-form input[name=budget_s]", "900")
    page.select_option("#tuning-form select[name=end_on]", "best")
    page.click("#tuning-form button[type=submit]")
    page.wait_for_selector("[data-tuning-note]:not([hidden])")
    assert "production app" in page.inner_text("[data-tuning-note]")
    page.click("#tuning-form [data-confirm]")
    page.wait_for_url("**/tuning/*/")
    run_id = int(page.url.rstrip("/").rsplit("/", 1)[1])
    ended = _tuned(stack, run_id, 600)
    assert ended["status"] == "succeeded", (ended["status_message"], ended["progress"])
    page.wait_for_function("document.querySelector('#tuning-run [data-status]').textContent === 'succeeded'",
                           timeout=60_000)  # fmt: skip
    page.wait_for_selector("#trials tbody tr[data-trial='3']")
    page.wait_for_selector("#tradeoffs .uplot")
    screenshot("tuning-run")

    run = _tuning(stack, run_id)
    assert run["spec"]["search"] == "grid" and len(run["trials"]) == 4, run["status_message"]
    trials = {t["number"]: t for t in run["trials"]}
    assert all(t["status"] == "measured" for t in trials.values()), [t["reason"] for t in trials.values()]
    assert trials[0]["params"] == {"minilm.preferred_batch_sizes": [8], "minirank.instance_count": 1}
    for trial in trials.values():  # every alias was loaded in every trial, at once
        assert set(trial["figures"]) == {"embedder", "ranker"}
        assert all(f["requests"] > 0 and f["errors"] == 0 for f in trial["figures"].values()), trial["figures"]
    best = trials[run["result"]["best"]]
    figures = {n: (t["params"], t["goodput"], t["figures"]) for n, t in trials.items()}
    assert best["params"]["minilm.preferred_batch_sizes"] == [1], figures
    assert best["figures"]["embedder"]["goodput"] > trials[0]["figures"]["embedder"]["goodput"], figures
    assert best["goodput"] > trials[0]["goodput"], figures
    assert {"model": "minilm", "field": "preferred_batch_sizes", "from": [8], "to": [1]} in run["result"]["changes"]
    # Each trial was a generation.
    assert len({t["generation"] for t in trials.values()}) == 4
    last = max(t["generation"] for t in trials.values())
    if run["result"]["met"]:
        # It ended on its winner, in one roll-out from the last trial's plan (none when the last
        # trial was the winner), not back to the start and then on.
        applied = run["applied_generation"]
        assert applied == last + (best["number"] != 3), (applied, last, run["status_message"])
        assert f"trial {best['number']}'s plan" in run["status_message"], run["status_message"]
        page.reload()
        page.wait_for_selector("#applied")
    else:
        # A p99 over the twenty requests of a trial can miss any target on a loaded CI core: then the
        # run puts its start back and says why (the unit tests hold both ends exactly), and the best
        # plan is applied from the run's page, which asks first (test_pages.py): yes.
        assert run["applied_generation"] is None and "no plan met every target" in run["status_message"], run
        _settled(stack, deployment, last + 1)
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#apply")
        page.wait_for_selector("#applied")
        applied = _tuning(stack, run_id)["applied_generation"]
        assert applied == last + 2, (applied, last)
    settled = _settled(stack, deployment, applied)
    assert settled["generation"] == applied
    assert _placements(stack, deployment)["minilm"] == ([1], start["minilm"][1])
    timeline = http.get(f"{stack.web_url}/api/deployments/{deployment['id']}/events/?limit=200", timeout=10).json()
    kinds = {e["kind"] for e in timeline["results"]}
    assert {"tuning.queued", "tuning.running", "tuning.trial.measured", "tuning.succeeded"} <= kinds
    exported = http.get(f"{url}{run_id}/export/?file=csv", timeout=10)
    rows = list(csv.DictReader(io.StringIO(exported.text)))
    assert [r["trial"] for r in rows] == ["0", "1", "2", "3"] and all(float(r["goodput"]) >= 0 for r in rows)
    assert float(rows[0]["embedder.request_latency_ms.target"]) == EMBED_TARGET_MS

    # Cancelled while it measures: the run ends cancelled and the settings it started from come back.
    second = http.post(url, json={**spec, "confirm": True, "trial_s": 60}, timeout=30)
    assert second.status_code == 201, second.text
    second = second.json()
    wait_for(lambda: _tuning(stack, second["id"])["progress"].get("state") == "measuring", 180, "trial 0 measuring")
    assert http.post(f"{url}{second['id']}/cancel/", timeout=10).status_code == 202
    second = _tuned(stack, second["id"], 120)
    assert second["status"] == "cancelled", second["status_message"]
    assert second["trials"][0]["status"] == "failed" and "before it was measured" in second["trials"][0]["reason"]
    assert second["start_generation"] == applied
    assert _placements(stack, deployment)["minilm"] == ([1], start["minilm"][1])

    # The host's worker SIGKILLed under a run: the next worker stops what it left, fails the run and puts the
    # starting settings back; the trials it measured are kept.
    third = http.post(url, json={**spec, "confirm": True}, timeout=30).json()
    # Trial 1 holds other settings than the run started from (the embedder's batch of 8 again).
    measuring = {"state": "measuring", "trial": 1}
    wait_for(lambda: measuring.items() <= _tuning(stack, third["id"])["progress"].items(), 240, "trial 1 measuring")
    assert _placements(stack, deployment)["minilm"][0] == [8]
    os.killpg(stack.worker.pid, signal.SIGKILL)
    stack.worker.wait()
    stack.start_worker()
    third = _tuned(stack, third["id"], 120)
    assert third["status"] == "failed" and "stopped (killed or restarted)" in third["status_message"], third
    assert [t["status"] for t in third["trials"]] == ["measured", "failed"]
    _settled(stack, deployment, third["trials"][1]["generation"] + 1)
    assert _placements(stack, deployment)["minilm"] == ([1], start["minilm"][1])
