"""Text generation through Gantry end to end: a checkpoint of a real
architecture made on this machine (untrained), registered and deployed on a
real worker and tritonserver, queried through the REST generate action as JSON
and as server-sent events, with bad input refused and a dropped stream
cancelled inside Triton."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from tests.integration.conftest import Stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def _ready_deployment(stack: Stack, tiny_llm: Path, minilm_path: Path) -> dict:
    stack.register_models(tiny_llm, tiny="llm")
    stack.register_models(minilm_path, minilm="embedding")
    http = stack.session()
    body = {
        "name": "chat",
        "host": stack.host_name,
        "models": [{"model": "tiny", "max_batch_size": 8, "max_queue_delay_us": 500}, {"model": "minilm"}],
    }
    created = http.post(f"{stack.web_url}/api/deployments/", json=body, timeout=30)
    assert created.status_code == 201, created.text
    url = f"{stack.web_url}/api/deployments/{created.json()['id']}/"
    assert http.post(url + "start/", timeout=30).status_code == 202

    def ready() -> dict | None:
        current = http.get(url, timeout=10).json()
        assert current["status"] != "failed", current["status_message"]
        return current if current["status"] == "ready" else None

    return wait_for(ready, 240, "the deployment to be ready", interval_s=0.5)


def _events(response: requests.Response) -> list[dict]:
    return [json.loads(line[5:]) for line in response.iter_lines(decode_unicode=True) if line.startswith("data:")]


def test_llm_generates_json_and_streams_and_a_dropped_stream_is_cancelled_in_triton(
    stack: Stack, tiny_llm: Path, minilm_path: Path
):
    deployment = _ready_deployment(stack, tiny_llm, minilm_path)
    http = stack.session()
    generate = f"{stack.web_url}/api/deployments/{deployment['id']}/generate/"

    # One JSON answer, reproducible with a seed; usage counts tokens.
    body = {"prompt": "The weather today is", "max_tokens": 12, "seed": 42, "temperature": 0.8, "top_p": 0.9}
    first = http.post(generate, json=body, timeout=60)
    assert first.status_code == 200, first.text
    answer = first.json()
    assert answer["model"] == "tiny" and answer["text"]
    assert answer["notice"].startswith("untrained")
    assert 0 < answer["usage"]["completion_tokens"] <= 12 and answer["usage"]["prompt_tokens"] > 0
    assert answer["finish_reason"] in ("length", "stop") and answer["time_to_first_token_ms"] > 0
    assert http.post(generate, json=body, timeout=60).json()["text"] == answer["text"]

    # Chat messages go through the checkpoint's template; the embedder beside it still answers.
    chat = http.post(generate, json={"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 5}, timeout=60)
    assert chat.status_code == 200, chat.text
    embedded = http.post(
        f"{stack.web_url}/api/deployments/{deployment['id']}/embed/", json={"texts": ["a"]}, timeout=60
    )
    assert embedded.status_code == 200 and len(embedded.json()["embeddings"][0]) == 384

    # Streaming: pieces of text as they come, then the summary.
    with http.post(generate, json={**body, "stream": True, "max_tokens": 20}, stream=True, timeout=60) as streamed:
        assert streamed.status_code == 200 and streamed.headers["Content-Type"].startswith("text/event-stream")
        events = _events(streamed)
    pieces, summary = events[:-1], events[-1]
    assert len(pieces) >= 2 and all(p["text"] for p in pieces)
    assert summary["done"] and summary["usage"]["completion_tokens"] == sum(p["tokens"] for p in pieces)
    assert summary["tokens_per_s"] > 0

    # Bad input names the field and the rule; nothing reaches Triton.
    refusals = {
        "best_of": ({"prompt": "a", "best_of": 2}, "is not a known field"),
        "max_tokens": ({"prompt": "a", "max_tokens": 600}, "must be below 512"),
        "prompt": ({"prompt": ""}, "may not be blank"),
        "temperature": ({"prompt": "a", "temperature": -1}, "greater than or equal to 0"),
    }
    for field, (bad, rule) in refusals.items():
        refused = http.post(generate, json=bad, timeout=30)
        assert refused.status_code == 400, (field, refused.text)
        assert rule in " ".join(refused.json()["errors"][field]), refused.text
    assert requests.post(generate, json={"prompt": "a"}, timeout=30).status_code == 401

    # A client that drops the stream halfway cancels the request inside Triton.
    dropped = http.post(
        generate, json={"prompt": "Tell me", "max_tokens": 400, "stream": True}, stream=True, timeout=60
    )
    first_piece = next(line for line in dropped.iter_lines(decode_unicode=True) if line.startswith("data:"))
    assert json.loads(first_piece[5:])["text"]
    dropped.close()

    def cancelled_line() -> str | None:
        log = http.get(f"{stack.web_url}/api/deployments/{deployment['id']}/log/?limit=500", timeout=10).json()
        return next((row["line"] for row in log["results"] if "cancelled by its client" in row["line"]), None)

    line = wait_for(cancelled_line, 30, "the model to log the cancelled request")
    produced = int(line.rsplit("after ", 1)[1].split()[0])
    assert produced < 400, line
