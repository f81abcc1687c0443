"""The attacker's view, for real: each finding of the security review tried
against a running Gantry (a real ASGI server, worker and tritonserver), and
shown closed.

- A burst of concurrent chats cannot spend past a key's tokens per minute
  (they were admitted all at once and charged only at their end: 5.7x over).
- Refused requests are not counted as requests.
- A key stops working when its owner loses the operator role (only
  is_active was checked).
- An embeddings call of many inputs counts one request per input.

(The generate action's throttle: tests/unit/playground/test_lean.py; the
sign-in lockout: tests/unit/access/test_limits.py; server environments, and
every Triton port bound to loopback: tests/integration/test_end_to_end.py;
Triton's ports and the channel tried from another address, and a revoked
host cut off: tests/integration/test_channel.py; the channel's refusals of
strangers, hosts' certificates and other ports:
tests/unit/workers/test_channel.py; a provider's person taking a local
account's name: tests/unit/access/test_oidc.py.)
"""

from __future__ import annotations

import threading
from pathlib import Path

import openai
import pytest
from django.contrib.auth.models import Group, User

from core.permissions import OPERATOR_GROUP
from gateway import services as gateway_services
from gateway.models import Usage
from tests.integration.conftest import Stack, wait_for
from tests.integration.test_gateway import _alias, _client, _deploy, _key

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def test_a_key_cannot_be_spent_past_its_limits_and_follows_its_owners_role(
    stack: Stack, tiny_llm: Path, minilm_path: Path
):
    stack.register_models(tiny_llm, tiny="llm")
    stack.register_models(minilm_path, minilm="embedding")
    deployment = _deploy(stack, "target", [{"model": "tiny", "max_batch_size": 8}, {"model": "minilm"}])
    _alias(stack, "chat", deployment, "tiny")
    _alias(stack, "embed", deployment, "minilm")

    # Twenty chats at once against 300 tokens a minute.
    limit, max_tokens = 300, 40
    key = _key(stack, all_aliases=True, tokens_per_minute=limit)
    client = _client(stack, key)
    served: list[int] = []
    refused: list[openai.RateLimitError] = []

    def chat(i: int) -> None:
        try:
            reply = client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": f"Tell me a story {i}"}], max_tokens=max_tokens
            )
            served.append(reply.usage.total_tokens)
        except openai.RateLimitError as exc:
            refused.append(exc)

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert served and refused, (served, len(refused))
    # One request's reservation: its rendered prompt's bytes and max_tokens (the prompt is under 200 bytes).
    assert sum(served) <= limit + 200 + max_tokens, served
    assert all(e.body["type"] == "tokens" and "left this minute" in e.body["message"] for e in refused)
    key_id = key["id"]
    wait_for(lambda: Usage.objects.filter(key_id=key_id, alias="chat").exists(), 10, "the usage flush")
    # Refusals are counted apart from the requests served; both are flushed in the background.
    counted = lambda: Usage.objects.filter(key_id=key_id, alias="chat").values_list("requests", "refused").get()  # noqa: E731
    wait_for(lambda: counted() == (len(served), len(refused)), 10, "the served and refused counts")

    # Embeddings count one request per input: 8 inputs against 10 a minute leave room for 2.
    per_input = _client(stack, _key(stack, all_aliases=True, requests_per_minute=10))
    per_input.embeddings.create(model="embed", input=[f"sentence {i}" for i in range(8)])
    with pytest.raises(openai.RateLimitError) as over:
        per_input.embeddings.create(model="embed", input=["a", "b", "c"])
    assert "one per input" in over.value.body["message"]

    # A key works while its owner operates, and stops when the owner loses the role.
    owner = User.objects.create_user(username="leaving", password="leaving-pass")
    owner.groups.add(Group.objects.get_or_create(name=OPERATOR_GROUP)[0])
    created = gateway_services.key_create(name="theirs", user=owner, all_aliases=True)
    theirs = openai.OpenAI(base_url=f"{stack.web_url}/v1", api_key=created.secret, max_retries=0, timeout=60)
    assert theirs.embeddings.create(model="embed", input="x").data
    owner.groups.clear()

    def cut_off() -> bool:
        try:
            theirs.embeddings.create(model="embed", input="x")
        except openai.AuthenticationError as exc:
            return "no longer an operator" in exc.body["message"]
        return False

    wait_for(cut_off, 5, "the key to follow its owner's role", interval_s=0.5)
