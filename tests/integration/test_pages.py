"""What a new user meets on the pages, in headless Chromium against the real
web server: an untrained checkpoint labelled wherever it shows, a build form
offered only where a build can run, an alias's Move starting on what it
serves, load-test charts that hold every point, a tuning run that says no
plan met its targets (and asks before applying the closest), the tuning runs'
list in the menu, and a deployment page whose tabs each open in one click."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from gateway.models import Alias
from loadtests import services as loadtest_services
from loadtests.models import LoadTest, TuningRun, TuningTrial
from tests import factories
from tests.integration.conftest import Stack
from workers.untrained import make_untrained_llm

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def shown(stack: Stack, tmp_path: Path, minilm_path: Path) -> dict[str, Any]:
    """The rows the pages show, made before Chromium starts (its event loop owns the thread)."""
    from hosts.models import GpuHost

    host = GpuHost.objects.get(name=stack.host_name)
    llm = factories.registered_model(
        name="tiny-llm", kind="llm", path=make_untrained_llm(tmp_path / "tiny-llm"), host=host
    )
    factories.registered_model(name="minilm", kind="embedding", path=minilm_path, host=host)
    deployment = factories.deployment(host=host, models=["minilm", "tiny-llm"], name="pages", user=stack.user)
    Alias.objects.create(name="chat", deployment=deployment, triton_name="tiny-llm")
    Alias.objects.create(name="embed", deployment=deployment, triton_name="minilm")

    run = LoadTest.objects.create(
        deployment=deployment, deployment_name=deployment.name, alias="embed", triton_name="minilm",
        kind="embedding", status="succeeded",
        workload={"mode": "concurrency", "levels": [1, 4, 16], "duration_s": 10, "input_tokens": 32,
                  "batch_size": 1, "streaming": False, "direct": True, "native": False, "thresholds": {},
                  "seed": 0, "dataset": None},
        context={"deployment": {"id": deployment.pk, "generation": 1}, "host": {"gpus": []}},
    )  # fmt: skip
    now = timezone.now()
    highest, fastest = 0.0, 0.0
    for target, scale in (("gateway", 1.0), ("triton", 3.0)):  # Triton's curve goes past the gateway's
        for level in (1, 4, 16):
            p99, throughput = 10.0 * level * scale, 5.0 * level * scale
            highest, fastest = max(highest, p99), max(fastest, throughput)
            summary = {"request_throughput": throughput, "request_latency": {"p99": p99, "p50": p99 / 2}}
            loadtest_services.point_save(
                run_id=run.pk, target=target, level=level, complete=True, records=[], summary=summary,
                server={}, started_at=now, finished_at=now + dt.timedelta(seconds=10),
            )  # fmt: skip

    targets = {"request_latency_ms": 50.0}
    tuning = TuningRun.objects.create(
        deployment=deployment, deployment_name=deployment.name, start_generation=1, status="succeeded",
        spec={"mix": [{"model": "embed", "rate": 20, "targets": targets}], "search": "grid", "grid_size": 2,
              "space": {"minilm": {"max_batch_size": [8, 16]}}, "trial_s": 10, "max_trials": 2, "budget_s": 60},
    )  # fmt: skip
    for number, (goodput, p99) in enumerate([(0.2, 400.0), (0.6, 1000.0)]):  # both miss 50 ms by 8-20x
        TuningTrial.objects.create(
            run=tuning, number=number, params={"minilm.max_batch_size": 8 * (number + 1)}, status="measured",
            goodput=goodput, figures={"embed": {"goodput": goodput, "p99": {"request_latency_ms": p99},
                                                "targets": targets, "met": False}},
        )  # fmt: skip
    return {"llm": llm, "deployment": deployment, "run": run, "highest": highest, "fastest": fastest, "tuning": tuning}


def _sign_in(page, stack: Stack) -> None:  # noqa: ANN001
    page.goto(f"{stack.web_url}/login/")
    page.fill("input[name=username]", stack.user.username)
    page.fill("input[name=password]", "operator-pass")
    page.click("button[type=submit]")
    page.wait_for_url(f"{stack.web_url}/")


def test_the_pages_say_what_a_new_user_must_know(stack: Stack, shown: dict[str, Any], page, screenshot):  # noqa: ANN001
    failed: list[str] = []
    page.on("response", lambda r: r.status >= 400 and failed.append(f"{r.status} {r.request.method} {r.url}"))
    _sign_in(page, stack)

    # The untrained checkpoint, labelled on the dashboard (its model row and its deployment's) and its page.
    expect(page.locator("table").filter(has_text="tiny-llm").first).to_contain_text("untrained")
    expect(page.locator("#deployments")).to_contain_text("tiny-llm (untrained)")
    page.goto(f"{stack.web_url}/models/{shown['llm'].pk}/")
    expect(page.locator("#model-notice")).to_contain_text("untrained: random weights")
    # A host without a GPU cannot build: no form opens on a refusal, the page says what a build needs.
    expect(page.locator("#build-unavailable")).to_contain_text("a host with a GPU")
    assert page.locator("#build-form").count() == 0
    screenshot("model-untrained")

    # Each alias's Move starts on what it serves, among models of its kind.
    page.goto(f"{stack.web_url}/gateway/")
    chat = page.locator("select[id^=move-]").nth(0)
    embed = page.locator("select[id^=move-]").nth(1)
    deployment_id = shown["deployment"].pk
    expect(chat).to_have_value(f"{deployment_id}/tiny-llm")
    expect(embed).to_have_value(f"{deployment_id}/minilm")
    assert "embedding" not in chat.inner_text()

    # The load test's charts hold every point of every curve.
    page.goto(f"{stack.web_url}/loadtests/{shown['run'].pk}/")
    chart = page.locator("#curves figure[data-y-max]").first
    expect(chart).to_have_attribute("data-y-max", re.compile(r"\d"))
    assert float(chart.get_attribute("data-y-max")) >= shown["highest"]
    assert float(chart.get_attribute("data-x-max")) >= shown["fastest"]
    expect(page.locator("#loadtest")).not_to_contain_text("direct=True")
    expect(page.locator("#loadtest")).to_contain_text("through the gateway and straight to Triton")

    # The tuning runs are in the menu; a run whose every trial missed says so and asks before applying.
    page.goto(f"{stack.web_url}/")
    page.click("header nav >> text=Tuning")
    expect(page.locator("#tuning-runs")).to_contain_text("no plan met the targets")
    page.click(f"#tuning-runs a[href='/tuning/{shown['tuning'].pk}/']")
    expect(page.locator("#best")).to_contain_text("No plan met the targets")
    expect(page.locator("#best")).not_to_contain_text("the starting plan's")
    asked: list[str] = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.dismiss()))
    page.click("#apply")
    page.wait_for_timeout(500)
    assert asked and "No plan met the targets" in asked[0]
    screenshot("tuning-no-plan-met")

    # The deployment page: each tab in one click, the address naming it.
    page.goto(f"{stack.web_url}/deployments/{deployment_id}/")
    for tab in ("playground", "metrics-panel", "gpu-plan", "testing", "versions", "log-panel", "timeline"):
        if page.locator(f"#tab-{tab}").count() == 0:
            continue  # no GPU plan on a host without GPUs
        page.click(f"#tab-{tab}")
        expect(page.locator(f"#{tab}")).to_be_visible()
        assert page.url.endswith(f"#{tab}")
    page.goto(f"{stack.web_url}/deployments/{deployment_id}/#timeline")
    expect(page.locator("#timeline")).to_be_visible()
    expect(page.locator("#playground")).to_be_hidden()
    screenshot("deployment-timeline-tab")
    assert not failed, failed
    # Dismissed, the apply asked nothing of the server (the database is read through the API:
    # Chromium's event loop owns this thread).
    run = stack.session().get(f"{stack.web_url}/api/tuning/{shown['tuning'].pk}/", timeout=10).json()
    assert run["applied_generation"] is None
