"""The user's paths in a real headless Chromium against a real server, worker
and tritonserver. Each saves screenshots of what the user saw under
var/screenshots/ (git-ignored): look at them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import requests

from tests.integration.conftest import Stack

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def _sign_in(page, stack: Stack, path: str = "/") -> None:  # noqa: ANN001
    page.goto(f"{stack.web_url}{path}")
    page.fill("input[name=username]", stack.user.username)
    page.fill("input[name=password]", "operator-pass")
    page.click("button[type=submit]")


def _tab_to(page, text: str, *, tag: str = "A", name: str = "", presses: int = 40) -> None:  # noqa: ANN001
    """Press Tab until the focus is on a ``tag`` element with this text (or this name): it is reachable by keyboard."""
    for _ in range(presses):
        page.keyboard.press("Tab")
        focused = page.evaluate(
            "(() => { const e = document.activeElement;"
            " return [e.tagName, (e.textContent || '').trim(), e.getAttribute('name') || '']; })()"
        )
        if focused[0] == tag and (focused[1] == text if text else focused[2] == name):
            return
    raise AssertionError(f"no {tag} {text or name!r} within {presses} presses of Tab")


def test_user_registers_plans_deploys_queries_changes_and_deletes_from_the_browser(
    stack: Stack, minilm_path: Path, tiny_llm: Path, page, screenshot
):
    """The main path, all in the browser: register a checkpoint, plan the
    three-model stack (an llm, an embedder, a reranker) with the server's
    checks shown by field, deploy, watch it become ready without a reload, chat,
    embed, rerank, watch the charts get points, change the generation, roll it
    back, restart, stop and delete."""
    from playwright.sync_api import expect

    _sign_in(page, stack)
    expect(page.get_by_text(stack.host_name).first).to_be_visible()

    # By keyboard alone: the skip link comes first; the menu leads to the models page and its form.
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to content"
    _tab_to(page, "Models")
    page.keyboard.press("Enter")
    page.wait_for_url("**/models/")
    _tab_to(page, "", tag="INPUT", name="name")
    page.keyboard.type("Mini LM")
    # Register: a bad name is refused beside its field, then the checkpoint registers and its inspection finishes live.
    form = page.locator("#register-form")
    form.locator("select[name=kind]").select_option("embedding")
    form.locator("select[name=host]").select_option(stack.host_name)
    form.locator("input[name=path]").fill(str(minilm_path))
    form.locator("button[type=submit]").click()
    expect(page.locator("#register-form .field-error")).to_contain_text("lowercase")
    screenshot("models-refused")
    page.locator("#register-form input[name=name]").fill("minilm")
    page.locator("#register-form button[type=submit]").click()
    expect(page.locator("#inspection [data-status]")).to_have_text("ready", timeout=60_000)
    expect(page.locator("#model")).to_contain_text("BertModel")
    screenshot("model")
    stack.register_models(minilm_path, ranker="reranker")
    stack.register_models(tiny_llm, tiny="llm")

    # Plan: three models; a GPU this host lacks is named beside its field before anything is saved.
    page.click("#deploy-link")
    page.fill("input[name=name]", "browser-stack")
    page.select_option("select[name=host]", stack.host_name)
    page.select_option("[name='models[0].model']", "tiny")
    page.click("[data-add-model]")
    page.select_option("[name='models[1].model']", "minilm")
    page.fill("[name='models[1].max_batch_size']", "16")
    page.fill("[name='models[1].preferred_batch_sizes']", "4,8")
    page.click("[data-add-model]")
    page.select_option("[name='models[2].model']", "ranker")
    page.fill("[name='models[2].gpu_ids']", "3")
    expect(page.locator("[data-error-for='models[2].gpu_ids']")).to_contain_text("has no GPU with index [3]")
    expect(page.locator("[data-summary]")).to_contain_text("problem")
    page.fill("[name='models[2].preferred_batch_sizes']", "64")
    expect(page.locator("[data-error-for='models[2].preferred_batch_sizes']")).to_contain_text("max_batch_size")
    screenshot("deploy-refused")
    page.fill("[name='models[2].gpu_ids']", "")
    page.fill("[name='models[2].preferred_batch_sizes']", "")
    expect(page.locator("[data-summary]")).to_contain_text("checks pass")
    screenshot("deploy")
    page.click("#deploy-form button[type=submit]")
    expect(page.locator("h1")).to_contain_text("browser-stack")
    badge = page.locator("#deployment [data-status]")
    expect(badge).to_have_text("pending")
    expect(page.locator("#live-indicator")).to_have_text("live")

    page.click("#start")
    # No reload: the websocket moves the badge through launching and loading to ready.
    expect(badge).to_have_text("ready", timeout=240_000)
    timeline = page.locator("#events").inner_text()
    for status in ("launching", "loading", "ready"):
        assert status in timeline
    # Each model's readiness, as the host agent last asked Triton.
    for name in ("minilm", "ranker", "tiny"):
        expect(page.locator(f"[data-model-ready={name}]")).to_have_text("ready", timeout=30_000)

    # The three playgrounds.
    page.fill("#chat-max-tokens", "8")
    page.fill("#chat-input", "Hello")
    page.click("#chat-send")
    expect(page.locator("#chat-figures")).to_contain_text("time to first token", timeout=60_000)
    page.click("#embed")
    expect(page.locator("#embed-result")).to_contain_text("384 dimensions", timeout=60_000)
    page.click("#rerank")
    expect(page.locator("#rerank-result")).to_contain_text("Triton loads models", timeout=60_000)
    # The agent's scrapes reach the charts over the websocket: points, and a request rate above zero.
    expect(page.locator("#metrics")).to_contain_text("minilm", timeout=30_000)
    requests_chart = page.locator("figure[data-chart=request_rate]")
    page.wait_for_function(
        "() => Number(document.querySelector('figure[data-chart=request_rate]').dataset.points) >= 3", timeout=30_000
    )
    expect(requests_chart.locator(".u-legend")).to_contain_text("minilm")
    expect(page.locator("#server-log")).to_contain_text("successfully loaded 'minilm'", timeout=30_000)
    screenshot("deployment-ready")

    # Autoscaling from the page: a bad bound is refused by field, good ones are said in words.
    page.click("#autoscale summary")
    form = page.locator("#autoscale-form")
    form.locator("[name=min_replicas]").fill("3")
    form.locator("[name=max_replicas]").fill("2")
    form.locator("#autoscale-save").click()
    expect(page.locator("#action-error")).to_contain_text("min_replicas")
    form.locator("[name=min_replicas]").fill("1")
    form.locator("[name=max_replicas]").fill("2")
    form.locator("#autoscale-save").click()
    expect(page.locator("#autoscale-words")).to_contain_text("1..2 replicas, holding 4 requests in flight per replica")
    expect(page.locator("#events")).to_contain_text("autoscaling: 1..2 replicas", timeout=10_000)
    screenshot("deployment-autoscale")
    form.locator("[name=max_replicas]").fill("")
    form.locator("#autoscale-save").click()
    expect(page.locator("#autoscale-words")).to_have_text("off")

    # A new generation from the page's change form, applied in place; then rolled back from the generations.
    page.click("#tab-versions")
    page.click("#change summary")
    change = page.locator("#change-form")
    # The form holds the generation's placements, by name: minilm, ranker, tiny.
    expect(change.locator("[name='models[0].model']")).to_have_value("minilm")
    change.locator("[name='models[0].max_batch_size']").fill("8")
    change.locator("[name='models[0].preferred_batch_sizes']").fill("")
    expect(change.locator("[data-summary]")).to_contain_text("checks pass")
    change.locator("button[type=submit]").click()
    expect(change.locator("[data-summary]")).to_contain_text("Generation 2 asked for")
    revisions = page.locator("#revisions")
    expect(revisions).to_contain_text("minilm.max_batch_size: 16 → 8", timeout=30_000)
    expect(badge).to_have_text("ready", timeout=120_000)
    screenshot("deployment-generations")
    page.locator("#revisions button[data-generation='1']").click()
    expect(revisions).to_contain_text("minilm.max_batch_size: 8 → 16", timeout=30_000)
    expect(revisions).to_contain_text("rolled back to generation 1")
    expect(badge).to_have_text("ready", timeout=120_000)

    # Restart: stopping, then launching again, to ready, all without a reload.
    page.click("#restart")
    expect(page.locator("#events")).to_contain_text("restart requested", timeout=10_000)
    # The request is on the timeline before the worker stops the server: the badge leaves
    # ready first (on a loaded machine it could still read ready here), then comes back.
    expect(badge).not_to_have_text("ready", timeout=60_000)
    expect(badge).to_have_text("ready", timeout=240_000)

    # The dashboard: the deployment's sparkline has points; the events page tells the story.
    page.click("nav >> text=Dashboard")
    row = page.locator("#deployments tr", has_text="browser-stack")
    expect(row.locator("[data-status]")).to_have_text("ready")
    page.wait_for_function(
        "() => [...document.querySelectorAll('[data-sparkline]')].some((e) => Number(e.dataset.points) >= 1)",
        timeout=30_000,
    )
    screenshot("dashboard")
    page.click("nav >> text=Events")
    page.fill("#id_kind", "deployment.")
    page.click("#event-filter button[type=submit]")
    expect(page.locator("#event-list")).to_contain_text("rolled back to generation 1")
    screenshot("events")

    page.go_back()
    page.go_back()
    page.click("#deployments >> text=browser-stack")
    page.click("#stop")
    expect(page.locator("#deployment [data-status]")).to_have_text("stopped", timeout=60_000)
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#delete")
    page.wait_for_url(f"{stack.web_url}/")
    expect(page.locator("#deployments")).not_to_contain_text("browser-stack")


@pytest.fixture
def chat_deployment(stack: Stack, tiny_llm: Path) -> int:
    """A ready deployment of the untrained Llama, made over the REST API."""
    from tests.integration.conftest import wait_for

    stack.register_models(tiny_llm, tiny="llm")
    http = stack.session()
    body = {"name": "chat", "host": stack.host_name, "models": [{"model": "tiny"}]}
    created = http.post(f"{stack.web_url}/api/deployments/", json=body, timeout=30).json()
    url = f"{stack.web_url}/api/deployments/{created['id']}/"
    http.post(url + "start/", timeout=30)
    wait_for(lambda: http.get(url, timeout=10).json()["status"] == "ready", 240, "the chat deployment")
    return created["id"]


def test_chat_streams_tokens_and_stop_cancels_inside_triton(stack: Stack, chat_deployment: int, page, screenshot):
    from playwright.sync_api import expect

    from tests.integration.conftest import wait_for

    page.goto(f"{stack.web_url}/deployments/{chat_deployment}/")
    page.fill("input[name=username]", stack.user.username)
    page.fill("input[name=password]", "operator-pass")
    page.click("button[type=submit]")
    expect(page.locator("#chat-notice")).to_contain_text("untrained")

    # A short answer streams in, with its figures.
    page.fill("#chat-max-tokens", "16")
    page.fill("#chat-input", "Hello there")
    page.click("#chat-send")
    expect(page.locator("#chat-figures")).to_contain_text("time to first token", timeout=60_000)
    expect(page.locator("#chat-figures")).to_contain_text("tokens/s")
    assert page.locator(".turn.assistant").first.inner_text().strip()

    # A long one is stopped midway: the page stops, and so does the model inside Triton.
    # The tiny model writes 400 tokens in about two seconds: on a loaded machine an answer
    # may end before the click lands, and then it is asked again (at most three times).
    page.fill("#chat-max-tokens", "400")
    page.fill("#chat-temperature", "1.5")
    figures = page.locator("#chat-figures")
    for attempt in range(3):
        page.fill("#chat-input", "Tell me everything")
        page.click("#chat-send")
        answer = page.locator(".turn.assistant").nth(1 + attempt)
        expect(answer).not_to_be_empty(timeout=60_000)
        page.click("#chat-stop")
        expect(figures).to_contain_text(re.compile(r"stopped after|\(length\)"), timeout=10_000)
        if "stopped after" in figures.inner_text():
            break
    expect(figures).to_contain_text("stopped after")
    expect(page.locator("#chat-send")).to_be_enabled()
    screenshot("chat-stopped")

    http = stack.session()

    def cancelled() -> str | None:
        page = http.get(f"{stack.web_url}/api/deployments/{chat_deployment}/log/?limit=500", timeout=10).json()
        return next((row["line"] for row in page["results"] if "cancelled by its client" in row["line"]), None)

    line = wait_for(cancelled, 30, "the model to log the cancelled request")
    assert int(line.rsplit("after ", 1)[1].split()[0]) < 400


@pytest.fixture
def stopped_deployment(stack: Stack, minilm) -> int:  # noqa: ANN001
    from tests import factories

    return factories.deployment(host=minilm.host, name="gw-target").pk


def test_operator_makes_an_alias_and_a_key_in_the_browser_and_the_key_works_until_revoked(
    stack: Stack, stopped_deployment: int, page, screenshot
):
    import openai
    from playwright.sync_api import expect

    from tests.integration.conftest import wait_for

    page.goto(f"{stack.web_url}/gateway/")
    page.fill("input[name=username]", stack.user.username)
    page.fill("input[name=password]", "operator-pass")
    page.click("button[type=submit]")

    page.fill("#alias-form input[name=name]", "team/embedder")
    page.select_option("#alias-form select[name=target]", f"{stopped_deployment}/minilm")
    page.click("#alias-form button[type=submit]")
    expect(page.locator("#aliases")).to_contain_text("gw-target / minilm")

    # A refused key names its field, and nothing is created.
    page.fill("#key-form input[name=name]", "notebook")
    page.click("#key-form button[type=submit]")
    expect(page.locator("#key-form")).to_contain_text("name the aliases this key may use")
    expect(page.locator("#keys")).to_contain_text("no keys yet")

    page.fill("#key-form input[name=name]", "notebook")
    page.select_option("#key-form select[name=aliases]", ["team/embedder"])
    page.fill("#key-form input[name=requests_per_minute]", "100")
    page.click("#key-form button[type=submit]")
    secret = page.locator("#new-secret").inner_text().strip()
    assert secret.startswith("gk-")
    expect(page.locator("#keys")).to_contain_text(secret[:10])
    screenshot("gateway")

    client = openai.OpenAI(base_url=f"{stack.web_url}/v1", api_key=secret, max_retries=0)
    assert [m.id for m in client.models.list()] == ["team/embedder"]

    # Shown once: a reload shows only the prefix.
    page.reload()
    expect(page.locator("#new-secret")).to_have_count(0)
    assert secret not in page.content()

    page.click("#keys button.danger")
    expect(page.locator("#keys")).to_contain_text("revoked")

    def refused() -> bool:
        try:
            client.models.list()
        except openai.AuthenticationError:
            return True
        return False

    wait_for(refused, 5, "the revoked key to be refused")

    # A personal API token: made on the tokens page, shown once, works on the API until revoked.
    page.click("nav >> text=API tokens")
    page.fill("#token-form input[name=name]", "notebook")
    page.click("#token-form button[type=submit]")
    token = page.locator("#new-secret").inner_text().strip()
    assert token.startswith("gt-")
    headers = {"Authorization": f"Bearer {token}"}
    assert requests.get(f"{stack.web_url}/api/hosts/", headers=headers, timeout=10).status_code == 200
    screenshot("tokens")
    page.click("#tokens button[aria-label='Revoke notebook']")
    expect(page.locator("#tokens tr", has_text="notebook")).to_contain_text("revoked")
    wait_for(
        lambda: requests.get(f"{stack.web_url}/api/hosts/", headers=headers, timeout=10).status_code == 401,
        5,
        "the revoked token to be refused",
    )


@pytest.fixture
def quiet_deployment(stack_on_own_redis: Stack, minilm) -> int:  # noqa: ANN001
    from tests import factories

    return factories.deployment(host=minilm.host, name="quiet").pk


def test_a_page_repairs_a_lost_message_and_marks_itself_stale_while_redis_is_down(
    stack_on_own_redis: Stack, own_redis, quiet_deployment: int, page, screenshot
):
    import threading

    import redis
    from django.db import connection
    from playwright.sync_api import expect

    from core import events
    from core.models import Event

    stack = stack_on_own_redis
    # The page re-reads the timeline each time its socket opens; counting those
    # re-reads lets the test wait for the first to finish, so that it cannot pick
    # up the lost event below by itself.
    page.add_init_script(
        'document.addEventListener("gantry:resync", () => { window.resyncs = (window.resyncs || 0) + 1; });'
    )
    page.goto(f"{stack.web_url}/deployments/{quiet_deployment}/")
    page.fill("input[name=username]", stack.user.username)
    page.fill("input[name=password]", "operator-pass")
    page.click("button[type=submit]")
    indicator = page.locator("#live-indicator")
    expect(indicator).to_have_text("live")
    page.wait_for_function("window.resyncs >= 1")

    # A message lost on its way: its event is in the database and its number was
    # taken, but no socket got it (the ORM runs outside Playwright's event loop).
    def lose() -> None:
        try:
            Event.objects.create(
                deployment_id=quiet_deployment, kind="test.lost", source="system", message="never delivered live"
            )
        finally:
            connection.close()  # this thread's own session, or the stack's teardown waits on it

    lost = threading.Thread(target=lose)
    lost.start()
    lost.join()
    redis.Redis(port=own_redis.port).incr(events.seq_key(events.deployment_group(quiet_deployment)))
    expect(page.locator("#events")).not_to_contain_text("never delivered live")
    # The next message shows the gap; the page re-reads the timeline over REST.
    stack.session().post(f"{stack.web_url}/api/deployments/{quiet_deployment}/start/", timeout=30)
    expect(page.locator("#events")).to_contain_text("never delivered live", timeout=10_000)

    own_redis.stop()
    expect(indicator).to_contain_text("not live", timeout=15_000)
    assert page.evaluate("document.body.dataset.live") == "down"
    expect(page.locator("#deployment [data-status]")).to_have_css("outline-style", "dashed")
    screenshot("deployment-stale")
    own_redis.start()
    expect(indicator).to_have_text("live", timeout=30_000)
    assert page.evaluate("document.body.dataset.live") == "up"
