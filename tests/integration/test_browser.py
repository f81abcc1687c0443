"""The user's path in a real headless Chromium: log in, open the model, create
a deployment, start it, watch it become ready without reloading, embed
sentences in the playground, restart it, roll a generation back, stop and
delete it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import Stack

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def test_user_deploys_queries_and_stops_from_the_browser(stack: Stack, minilm, page, tmp_path: Path):
    from playwright.sync_api import expect

    model = minilm
    page.goto(f"{stack.web_url}/")
    page.fill("input[name=username]", stack.user.username)
    page.fill("input[name=password]", "operator-pass")
    page.click("button[type=submit]")
    expect(page.get_by_text(stack.host_name).first).to_be_visible()

    page.click(f"a[href='/models/{model.pk}/']")
    page.fill("input[name=name]", "browser-demo")
    page.select_option("select[name=host]", stack.host_name)
    page.click("#deploy-form button[type=submit]")
    expect(page.locator("h1")).to_contain_text("browser-demo")
    badge = page.locator("#deployment [data-status]")
    expect(badge).to_have_text("pending")
    expect(page.locator("#live-indicator")).to_have_text("live")

    page.click("#start")
    # No reload: the websocket moves the badge through launching and loading to ready.
    expect(badge).to_have_text("ready", timeout=240_000)
    timeline = page.locator("#events").inner_text()
    for status in ("launching", "loading", "ready"):
        assert status in timeline

    page.click("#embed")
    result = page.locator("#embed-result")
    expect(result).to_contain_text("384 dimensions", timeout=60_000)
    expect(result).to_contain_text("(384 numbers)")
    # The agent's metrics scrape reaches the page over the websocket.
    expect(page.locator("#metrics")).to_contain_text("minilm", timeout=30_000)
    expect(page.locator("#server-log")).to_contain_text("successfully loaded 'minilm'", timeout=30_000)
    page.screenshot(path=str(tmp_path / "deployment-ready.png"), full_page=True)

    # Restart: stopping, then launching again, to ready, all without a reload.
    page.click("#restart")
    expect(page.locator("#events")).to_contain_text("restart requested", timeout=10_000)
    expect(badge).to_have_text("ready", timeout=240_000)
    assert "stopping" in page.locator("#events").inner_text()

    # A new generation (made here through the API), then rolled back from the page.
    deployment_id = page.locator("#deployment").get_attribute("data-id")
    changed = stack.session().put(
        f"{stack.web_url}/api/deployments/{deployment_id}/models/",
        json={"models": [{"model": "minilm", "max_batch_size": 8}]},
        timeout=30,
    )
    assert changed.status_code == 202, changed.text
    revisions = page.locator("#revisions")
    expect(revisions).to_contain_text("minilm.max_batch_size: 32 → 8", timeout=30_000)
    expect(badge).to_have_text("ready", timeout=60_000)
    page.locator("#revisions button[data-generation='1']").click()
    expect(revisions).to_contain_text("minilm.max_batch_size: 8 → 32", timeout=30_000)
    expect(revisions).to_contain_text("rolled back to generation 1")
    expect(badge).to_have_text("ready", timeout=60_000)
    expect(page.locator("#revisions button[data-generation='3']")).to_be_disabled()  # the one serving
    page.screenshot(path=str(tmp_path / "deployment-generations.png"), full_page=True)

    page.click("#stop")
    expect(badge).to_have_text("stopped", timeout=60_000)
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#delete")
    page.wait_for_url(f"{stack.web_url}/")
    expect(page.locator("#deployments")).not_to_contain_text("browser-demo")


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


def test_chat_streams_tokens_and_stop_cancels_inside_triton(stack: Stack, chat_deployment: int, page, tmp_path: Path):
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
    page.fill("#chat-max-tokens", "400")
    page.fill("#chat-temperature", "1.5")
    page.fill("#chat-input", "Tell me everything")
    page.click("#chat-send")
    answer = page.locator(".turn.assistant").nth(1)
    expect(answer).not_to_be_empty(timeout=60_000)
    page.click("#chat-stop")
    expect(page.locator("#chat-figures")).to_contain_text("stopped after", timeout=10_000)
    expect(page.locator("#chat-send")).to_be_enabled()
    page.screenshot(path=str(tmp_path / "chat-stopped.png"), full_page=True)

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
    stack: Stack, stopped_deployment: int, page, tmp_path: Path
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
    page.screenshot(path=str(tmp_path / "gateway.png"), full_page=True)

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


@pytest.fixture
def quiet_deployment(stack_on_own_redis: Stack, minilm) -> int:  # noqa: ANN001
    from tests import factories

    return factories.deployment(host=minilm.host, name="quiet").pk


def test_a_page_repairs_a_lost_message_and_marks_itself_stale_while_redis_is_down(
    stack_on_own_redis: Stack, own_redis, quiet_deployment: int, page, tmp_path: Path
):
    import threading

    import redis
    from playwright.sync_api import expect

    from deployments import events
    from deployments.models import Event

    stack = stack_on_own_redis
    page.goto(f"{stack.web_url}/deployments/{quiet_deployment}/")
    page.fill("input[name=username]", stack.user.username)
    page.fill("input[name=password]", "operator-pass")
    page.click("button[type=submit]")
    indicator = page.locator("#live-indicator")
    expect(indicator).to_have_text("live")

    # A message lost on its way: its event is in the database and its number was
    # taken, but no socket got it (the ORM runs outside Playwright's event loop).
    lost = threading.Thread(
        target=lambda: Event.objects.create(
            deployment_id=quiet_deployment, kind="test.lost", source="system", message="never delivered live"
        )
    )
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
    expect(page.locator("#deployment [data-status]")).to_have_css("opacity", "0.6")
    page.screenshot(path=str(tmp_path / "deployment-stale.png"), full_page=True)
    own_redis.start()
    expect(indicator).to_have_text("live", timeout=30_000)
    assert page.evaluate("document.body.dataset.live") == "up"
