"""The OpenAI-compatible gateway end to end, with the official ``openai``
client against a real ASGI server, worker and tritonserver: an untrained
checkpoint of a real architecture (made on this machine) behind chat and
completions, the packaged MiniLM behind embeddings and rerank; keys, scopes,
expiry, revocation, rate limits, usage, aliases moved between deployments,
and a dropped stream cancelled inside Triton."""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from pathlib import Path

import numpy as np
import openai
import pytest
import requests

from tests.integration.conftest import Stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def _deploy(stack: Stack, name: str, models: list[dict]) -> dict:
    http = stack.session()
    created = http.post(
        f"{stack.web_url}/api/deployments/", json={"name": name, "host": stack.host_name, "models": models}, timeout=30
    )
    assert created.status_code == 201, created.text
    url = f"{stack.web_url}/api/deployments/{created.json()['id']}/"
    assert http.post(url + "start/", timeout=30).status_code == 202

    def ready() -> dict | None:
        current = http.get(url, timeout=10).json()
        assert current["status"] != "failed", current["status_message"]
        return current if current["status"] == "ready" else None

    return wait_for(ready, 240, f"{name} to be ready", interval_s=0.5)


def _alias(stack: Stack, name: str, deployment: dict, model: str) -> dict:
    body = {"name": name, "deployment": deployment["id"], "model": model}
    response = stack.session().post(f"{stack.web_url}/api/gateway/aliases/", json=body, timeout=30)
    assert response.status_code == 201, response.text
    return response.json()


def _key(stack: Stack, **fields) -> dict:  # noqa: ANN003
    response = stack.session().post(f"{stack.web_url}/api/gateway/keys/", json={"name": "k", **fields}, timeout=30)
    assert response.status_code == 201, response.text
    return response.json()


def _client(stack: Stack, key: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.web_url}/v1", api_key=key["key"], max_retries=0, timeout=60)


def test_the_openai_client_chats_completes_embeds_and_reranks_through_the_gateway(
    stack: Stack, tiny_llm: Path, minilm_path: Path
):
    stack.register_models(tiny_llm, tiny="llm")
    stack.register_models(minilm_path, minilm="embedding", minirank="reranker")
    deployment = _deploy(
        stack,
        "stack",
        [{"model": "tiny", "max_batch_size": 8, "max_queue_delay_us": 500}, {"model": "minilm"}, {"model": "minirank"}],
    )
    _alias(stack, "org/tiny-chat", deployment, "tiny")
    embed_alias = _alias(stack, "embedder", deployment, "minilm")
    _alias(stack, "reranker", deployment, "minirank")
    key = _key(stack, all_aliases=True)
    assert key["key"].startswith("gk-") and key["prefix"] == key["key"][:10]
    client = _client(stack, key)

    assert sorted(m.id for m in client.models.list()) == ["embedder", "org/tiny-chat", "reranker"]

    # Chat, whole: the checkpoint's chat template, a seed, usage, and the untrained notice.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(
        model="org/tiny-chat", messages=messages, max_tokens=12, seed=7, temperature=0.8, top_p=0.9
    )
    assert whole.object == "chat.completion" and whole.model == "org/tiny-chat"
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    assert whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.prompt_tokens > 5 and 0 < whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.model_extra["notice"].startswith("untrained")

    # Chat, streamed: a role chunk, content deltas, a finish chunk, then usage; same text for the same seed.
    stream = client.chat.completions.create(
        model="org/tiny-chat", messages=messages, max_tokens=12, seed=7, temperature=0.8, top_p=0.9,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    # Completions, whole and streamed; a stop string ends the text before it.
    completion = client.completions.create(model="org/tiny-chat", prompt="Once upon a time", max_tokens=10, seed=3)
    assert completion.object == "text_completion" and completion.choices[0].text
    assert completion.usage.prompt_tokens > 0
    pieces = list(client.completions.create(model="org/tiny-chat", prompt="Once upon a time", max_tokens=10, seed=3,
                                            stream=True))  # fmt: skip
    assert "".join(p.choices[0].text for p in pieces) == completion.choices[0].text
    # Its access line, written once the stream had ended: the bytes it sent and its seconds.
    streamed_line = r'"POST /v1/completions HTTP/1\.1" 200 [1-9]\d* \d+\.\d{3}$'
    wait_for(lambda: re.search(streamed_line, (stack.log_dir / "web.log").read_text(), re.M), 10, "its access line")

    # Embeddings: the client asks for base64 by default and decodes it; float gives the same vectors.
    texts = ["a cat sits on the mat", "a kitten rests on a rug", "stock prices fell today"]
    b64 = client.embeddings.create(model="embedder", input=texts)
    floats = client.embeddings.create(model="embedder", input=texts, encoding_format="float")
    vectors = np.array([d.embedding for d in floats.data])
    assert vectors.shape == (3, 384)
    np.testing.assert_allclose(np.array([d.embedding for d in b64.data]), vectors, atol=1e-6)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]
    assert floats.usage.prompt_tokens > len(texts) and floats.usage.total_tokens == floats.usage.prompt_tokens
    # The same vectors as Gantry's own playground action.
    playground = stack.session().post(
        f"{stack.web_url}/api/deployments/{deployment['id']}/embed/", json={"texts": texts}, timeout=30
    )
    np.testing.assert_allclose(np.array(playground.json()["embeddings"]), vectors, atol=1e-6)
    # More inputs than the model's max_batch_size (32) go in batches that fit.
    many = client.embeddings.create(model="embedder", input=[f"sentence {i}" for i in range(70)])
    assert [d.index for d in many.data] == list(range(70))

    # Rerank, in the shape rerank APIs share.
    gateway = requests.Session()
    gateway.headers["Authorization"] = f"Bearer {key['key']}"
    v1 = f"{stack.web_url}/v1"
    ranked = gateway.post(
        f"{v1}/rerank",
        json={"model": "reranker", "query": "a small cat", "documents": ["stock prices fell", {"text": "a kitten"}],
              "top_n": 1, "return_documents": True},
    )  # fmt: skip
    assert ranked.status_code == 200, ranked.text
    assert ranked.json()["results"] == [
        {"index": 1, "relevance_score": pytest.approx(ranked.json()["results"][0]["relevance_score"]),
         "document": {"text": "a kitten"}}
    ]  # fmt: skip
    assert ranked.json()["usage"]["total_tokens"] > 0

    # Refusals in OpenAI's shape, naming the parameter.
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=messages)
    # A prompt beyond the context: a 400 naming the prompt's field, streamed or not.
    long = [{"role": "user", "content": "word " * 2000}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as too_long:
            client.chat.completions.create(model="org/tiny-chat", messages=long, max_tokens=16, stream=stream)
        assert too_long.value.body["code"] == "context_length_exceeded", too_long.value.body
        assert too_long.value.body["param"] == "messages"
        assert "data:" not in too_long.value.body["message"]
        assert "exceed the model's context of 512 tokens" in too_long.value.body["message"]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="org/tiny-chat", prompt="word " * 2000, max_tokens=16)
    assert (too_long.value.body["code"], too_long.value.body["param"]) == ("context_length_exceeded", "prompt")
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    for kwargs, param in (
        ({"n": 17}, "n"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
        # This checkpoint's tokenizer is WordPiece and its template writes no tool calls: both say so.
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"extra_body": {"mystery": 1}}, "mystery"),
        ({"temperature": 3}, "temperature"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"max_tokens": 600}, "max_tokens"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**{"model": "org/tiny-chat", "messages": messages, **kwargs})
        assert refused.value.body["param"] == param, refused.value.body
        assert refused.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as wrong_kind:
        client.embeddings.create(model="org/tiny-chat", input="x")
    assert wrong_kind.value.body["code"] == "model_not_supported"
    assert wrong_kind.value.body["message"] == (
        "model 'org/tiny-chat' is an llm model; /v1/embeddings needs an embedding model"
    )
    with pytest.raises(openai.BadRequestError) as no_dimensions:
        client.embeddings.create(model="embedder", input="x", dimensions=64)
    assert no_dimensions.value.body["param"] == "dimensions"
    unknown = gateway.get(f"{v1}/nothing-here")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_url"
    assert gateway.post(f"{v1}/embeddings", data=b"{not json").json()["error"]["code"] == "invalid_json"
    deep = gateway.post(f"{v1}/embeddings", data=b"[" * 5000 + b"]" * 5000)
    assert deep.status_code == 400 and deep.json()["error"] == {
        "message": "the body must not nest deeper than 32 levels",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_json",
    }
    anonymous = requests.post(f"{v1}/embeddings", json={"model": "embedder", "input": "x"}, timeout=10)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
    rest_token = {"Authorization": f"Bearer {stack.token}"}
    wrong_door = requests.post(
        f"{v1}/embeddings", json={"model": "embedder", "input": "x"}, headers=rest_token, timeout=10
    )
    assert wrong_door.status_code == 401 and wrong_door.json()["error"]["message"].startswith(
        "This is a REST API token (gt-…): /v1 takes gateway keys (gk-…)."
    )

    # A client that drops a stream halfway cancels the request inside Triton.
    body = {"model": "org/tiny-chat", "messages": messages, "max_tokens": 400, "stream": True}
    with gateway.post(f"{v1}/chat/completions", json=body, stream=True, timeout=60) as dropped:
        lines = dropped.iter_lines(decode_unicode=True)
        assert next(line for line in lines if line.startswith("data:") and '"content": "' in line and '""' not in line)

    def cancelled_line() -> str | None:
        log = stack.session().get(f"{stack.web_url}/api/deployments/{deployment['id']}/log/?limit=500", timeout=10)
        return next((r["line"] for r in log.json()["results"] if "cancelled by its client" in r["line"]), None)

    line = wait_for(cancelled_line, 30, "the model to log the cancelled request")
    assert int(line.rsplit("after ", 1)[1].split()[0]) < 400, line

    # Usage per key and alias, counted and saved within a second or two.
    def usage() -> dict | None:
        body = stack.session().get(f"{stack.web_url}/api/gateway/usage/?key={key['id']}", timeout=10).json()
        rows = {row["alias"]: row for row in body["results"]}
        # Each web process flushes its own counts: wait for all of them.
        chats = rows.get("org/tiny-chat", {}).get("requests", 0)
        # Embeddings count one request per input: 3 + 3 + 70.
        embedded = rows.get("embedder", {}).get("requests")
        return rows if embedded == 76 and "reranker" in rows and chats >= 5 else None

    rows = wait_for(usage, 10, "usage to be saved")
    chat_row = rows["org/tiny-chat"]
    assert chat_row["requests"] >= 5 and chat_row["completion_tokens"] >= 2 * whole.usage.completion_tokens
    assert rows["embedder"]["prompt_tokens"] >= 2 * floats.usage.prompt_tokens

    # Requests refused before reaching a model (bad input, unknown model) are not counted;
    # those the model refused (the three prompts beyond its context, the grammar its
    # WordPiece tokenizer cannot follow) are, as failed.
    def listed() -> dict | None:
        body = stack.session().get(f"{stack.web_url}/api/gateway/keys/{key['id']}/", timeout=10).json()
        return body if body["usage"]["requests"] >= 86 else None

    counted = wait_for(listed, 10, "every web process's counts to be saved")
    # 10 calls of the other doors, and 76 embedding inputs.
    assert counted["last_used_at"] and counted["usage"]["requests"] == 86 and "key" not in counted

    # A deployment that is not ready answers 503 with Retry-After.
    http = stack.session()
    assert http.post(f"{stack.web_url}/api/deployments/{deployment['id']}/stop/", timeout=30).status_code == 202
    wait_for(
        lambda: http.get(f"{stack.web_url}/api/deployments/{deployment['id']}/", timeout=10).json()["status"]
        != "ready", 30, "the deployment to leave ready",
    )  # fmt: skip
    time.sleep(1.1)  # the gateway's one-second view of the alias
    with pytest.raises(openai.InternalServerError) as not_ready:
        client.embeddings.create(model="embedder", input="x")
    assert not_ready.value.status_code == 503 and not_ready.value.response.headers["retry-after"]
    assert not_ready.value.body["code"] == "model_not_ready"
    assert embed_alias["name"] == "embedder"


def test_keys_scope_expire_revoke_and_rate_limit_and_aliases_move_between_deployments(stack: Stack, minilm_path: Path):
    stack.register_models(minilm_path, minilm="embedding")
    first = _deploy(stack, "embed-a", [{"model": "minilm"}])
    second = _deploy(stack, "embed-b", [{"model": "minilm", "triton_name": "minilm-v2"}])
    alias = _alias(stack, "embed", first, "minilm")
    _alias(stack, "other", second, "minilm-v2")
    http = stack.session()

    # Scope: a key for "embed" only sees and uses "embed".
    scoped = _key(stack, aliases=["embed"])
    client = _client(stack, scoped)
    assert [m.id for m in client.models.list()] == ["embed"]
    assert client.embeddings.create(model="embed", input="x").data
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")

    # The alias moves to the other deployment at once, on both timelines; clients do not change.
    moved = http.patch(
        f"{stack.web_url}/api/gateway/aliases/{alias['id']}/", json={"deployment": second["id"], "model": "minilm-v2"},
        timeout=30,
    )  # fmt: skip
    assert moved.status_code == 200 and moved.json()["deployment_name"] == "embed-b", moved.text
    for deployment in (first, second):
        events = http.get(f"{stack.web_url}/api/deployments/{deployment['id']}/events/", timeout=10).json()["results"]
        assert any(e["kind"] == "alias.moved" and "embed-a/minilm to embed-b/minilm-v2" in e["message"]
                   for e in events), events  # fmt: skip
    assert http.post(f"{stack.web_url}/api/deployments/{first['id']}/stop/", timeout=30).status_code == 202
    wait_for(
        lambda: http.get(f"{stack.web_url}/api/deployments/{first['id']}/", timeout=10).json()["status"] == "stopped",
        60, "embed-a to stop",
    )  # fmt: skip
    time.sleep(1.1)
    assert client.embeddings.create(model="embed", input="still answers").data  # served by embed-b now

    # Revocation: within the gateway's one-second cache, the key stops working.
    assert http.post(f"{stack.web_url}/api/gateway/keys/{scoped['id']}/revoke/", timeout=10).status_code == 200

    def refused() -> bool:
        try:
            client.embeddings.create(model="embed", input="x")
        except openai.AuthenticationError as exc:
            return "revoked" in exc.body["message"]
        return False

    wait_for(refused, 5, "the revoked key to be refused")

    # Expiry.
    soon = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=2)).isoformat()
    expiring = _client(stack, _key(stack, all_aliases=True, expires_at=soon))
    assert expiring.embeddings.create(model="embed", input="x").data
    time.sleep(2.1)
    with pytest.raises(openai.AuthenticationError) as expired:
        expiring.embeddings.create(model="embed", input="x")
    assert "expired" in expired.value.body["message"]

    # Rate limit: two requests a minute, the third is refused with Retry-After.
    limited = _client(stack, _key(stack, all_aliases=True, requests_per_minute=2))
    limited.embeddings.create(model="embed", input="x")
    limited.embeddings.create(model="embed", input="x")
    with pytest.raises(openai.RateLimitError) as throttled:
        limited.embeddings.create(model="embed", input="x")
    assert throttled.value.body["code"] == "rate_limit_exceeded" and throttled.value.body["type"] == "requests"
    assert 1 <= int(throttled.value.response.headers["retry-after"]) <= 60

    # Tokens per minute: once the minute's tokens reach the limit, requests are refused.
    tokens = _key(stack, all_aliases=True, tokens_per_minute=5)
    by_tokens = _client(stack, tokens)
    by_tokens.embeddings.create(model="embed", input="one two three four five six seven")
    with pytest.raises(openai.RateLimitError) as out_of_tokens:
        wait_for(lambda: by_tokens.embeddings.create(model="embed", input="x") and False, 3, "the token limit")
    assert out_of_tokens.value.body["type"] == "tokens"

    # Bad key requests are refused by field, and nothing is created.
    before = http.get(f"{stack.web_url}/api/gateway/keys/", timeout=10).json()["count"]
    for body, field in (
        ({"name": "x"}, "aliases"),
        ({"name": "x", "aliases": ["nope"]}, "aliases"),
        ({"name": "x", "all_aliases": True, "requests_per_minute": 0}, "requests_per_minute"),
        ({"name": "x", "all_aliases": True, "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
    ):
        response = http.post(f"{stack.web_url}/api/gateway/keys/", json=body, timeout=10)
        assert response.status_code == 400 and field in response.json()["errors"], response.text
    assert http.get(f"{stack.web_url}/api/gateway/keys/", timeout=10).json()["count"] == before
    # Secrets are shown once, at creation, and never listed.
    listed = json.dumps(http.get(f"{stack.web_url}/api/gateway/keys/", timeout=10).json())
    assert scoped["key"] not in listed and tokens["key"] not in listed and '"key":' not in listed
    assert requests.get(f"{stack.web_url}/api/gateway/keys/", timeout=10).status_code == 401


def test_a_whole_answer_its_client_abandons_stops_in_triton_and_returns_its_reservation_at_once(
    stack: Stack, tiny_llm: Path
):
    stack.register_models(tiny_llm, tiny="llm")
    deployment = _deploy(stack, "abandon", [{"model": "tiny"}])
    _alias(stack, "chat", deployment, "tiny")
    # Room in the minute for one long answer's reservation (its prompt's bound and 440 tokens), not two.
    key = _key(stack, all_aliases=True, tokens_per_minute=800)
    body = {"model": "chat", "prompt": "Once upon a time", "max_tokens": 440, "temperature": 1.0}
    headers = {"Authorization": f"Bearer {key['key']}"}
    with pytest.raises(requests.Timeout):  # the client gives up, and closes its connection
        requests.post(f"{stack.web_url}/v1/completions", json=body, headers=headers, timeout=0.3)

    # The gateway noticed at once: the generation stopped, and what it used was counted and settled,
    # so a second long answer fits the minute while the first would still be generating.
    def admitted() -> requests.Response | None:
        answer = requests.post(f"{stack.web_url}/v1/completions", json=body, headers=headers, timeout=60)
        return answer if answer.status_code != 429 else None

    second = wait_for(admitted, 0.6, "a second long answer to be admitted", interval_s=0.1)
    assert second.status_code == 200, second.text

    def usage() -> list[dict] | None:
        rows = stack.session().get(f"{stack.web_url}/api/gateway/usage/", timeout=10).json()["results"]
        rows = [r for r in rows if r["key"] == key["id"]]
        return rows if rows and sum(r["requests"] for r in rows) == 2 else None

    rows = wait_for(usage, 30, "both requests counted")
    assert sum(r["completion_tokens"] for r in rows) < 2 * 440  # the first stopped early
