"""A scale-down under live streams cuts none of them. The LLM (a checkpoint
made here, untrained) serves one alias from two replicas on a real worker and
tritonserver; streamed chat completions through the gateway fill both, more
than each generates at once, so some wait in its queue; then the deployment is
scaled 2 -> 1. The retired replica leaves balancing, its page row says
"draining (n in flight)", its server answers every stream it holds to the
end, and only then is it stopped and removed. With a drain timeout of 0 the
same streams on it are cut (the Triton exit timeout alone, 5 s, is shorter
than they run), which is what this test would see if draining went away."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from tests.integration.conftest import Stack, wait_for
from tests.integration.test_browser import _sign_in
from tests.integration.test_gateway import _alias, _key
from tests.sse import chat_stream

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

STREAMS = 16
MAX_TOKENS = 480
DRAIN_S = 300


def _stream(url: str, key: str, results: list, index: int, begun: threading.Semaphore) -> None:
    body = {
        "model": "chat", "messages": [{"role": "user", "content": f"Tell me a long story, number {index}."}],
        "max_tokens": MAX_TOKENS,
    }  # fmt: skip
    results[index] = chat_stream(url, key, body, begun=begun, timeout_s=600)


def test_a_scale_down_under_live_streams_cuts_none_and_the_page_shows_the_drain(
    stack: Stack,
    tiny_llm: Path,
    page,
    screenshot,  # noqa: ANN001
):
    stack.register_models(tiny_llm, tiny="llm")
    http = stack.session()
    body = {
        "name": "chat", "host": stack.host_name, "replicas": 2, "drain_timeout_s": DRAIN_S,
        "models": [{"model": "tiny", "max_batch_size": 1}],
    }  # fmt: skip
    created = http.post(f"{stack.web_url}/api/deployments/", json=body, timeout=30)
    assert created.status_code == 201, created.text
    deployment = created.json()
    assert deployment["drain_timeout_s"] == DRAIN_S
    url = f"{stack.web_url}/api/deployments/{deployment['id']}/"
    assert http.post(url + "start/", timeout=30).status_code == 202
    wait_for(lambda: http.get(url, timeout=10).json()["status"] == "ready", 300, "two replicas ready", interval_s=0.5)
    _alias(stack, "chat", deployment, "tiny")
    key = _key(stack, all_aliases=True)["key"]
    _sign_in(page, stack, f"/deployments/{deployment['id']}/")
    page.wait_for_selector("#replicas tr[data-replica='2']")

    results: list[dict | None] = [None] * STREAMS
    begun = threading.Semaphore(0)
    threads = [
        threading.Thread(target=_stream, args=(f"{stack.web_url}/v1/chat/completions", key, results, i, begun))
        for i in range(STREAMS)
    ]
    for thread in threads:
        thread.start()
    for _ in range(2):  # one stream generating on each replica; seven more wait in each one's queue
        assert begun.acquire(timeout=120), results
    scaled = http.post(url + "scale/", json={"replicas": 1}, timeout=30)
    assert scaled.status_code == 202, scaled.text
    retired = next(r for r in scaled.json()["replica_set"] if r["desired_state"] == "stopped")
    assert retired["shown_status"] == "draining", retired

    # The page says it: the retired replica's row, with what it still holds.
    row = f"#replicas tr[data-replica='{retired['serial']}'] .status-draining"
    page.wait_for_selector(row, timeout=60_000)
    assert re.fullmatch(r"draining \(\d+ in flight\)", page.inner_text(row)), page.inner_text(row)
    screenshot("replica-draining")

    for thread in threads:
        thread.join(timeout=600)
    assert all(r is not None for r in results), results
    # Not one stream was cut: each ended with its finish_reason and [DONE], with no error event.
    assert all(not r.cut and r.finish_reason in ("length", "stop") for r in results), results

    # Then the retired replica was stopped and removed; its timeline says what it held and that it drained.
    wait_for(lambda: len(http.get(url, timeout=10).json()["replica_set"]) == 1, 120, "the retired replica removed")
    timeline = http.get(f"{url}events/?limit=200", timeout=10).json()["results"]
    drained = [e["message"] for e in timeline if e["kind"] == "replica.draining"]
    label = f"r{retired['serial']} on {stack.host_name}: "
    assert any(m.startswith(label + "drained in") for m in drained), drained
    held = [m for m in drained if m.startswith(label + "draining (stopping): ")]
    assert held and int(held[0].split(": ")[2].split()[0]) > 0, drained
