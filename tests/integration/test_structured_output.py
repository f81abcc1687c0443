"""OpenAI's structured output, log-probabilities, n and penalties through the
gateway, with the official ``openai`` client (its pydantic-typed ``parse``
helper included) against a real ASGI server, worker and tritonserver serving
an untrained Llama with a byte-level tokenizer (made on this machine): what an
application written against OpenAI's SDK calls."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Literal

import numpy as np
import openai
import pytest
import torch
from pydantic import BaseModel, Field
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.integration.conftest import Stack
from tests.integration.test_gateway import _alias, _client, _deploy, _key

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    colour: Literal["red", "green"]


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.untrained import make_untrained_llm

    return make_untrained_llm(tmp_path_factory.mktemp("llm") / "chat-llama", tokenizer="bpe")


def test_json_schemas_logprobs_n_and_penalties_through_the_openai_client(
    stack: Stack, chat_llm: Path, minilm_path: Path, tmp_path: Path
):
    from workers.untrained import make_untrained_encoder

    stack.register_models(chat_llm, chat="llm")
    stack.register_models(make_untrained_encoder(tmp_path / "mrl", kind="embedding", matryoshka=True), mrl="embedding")
    stack.register_models(minilm_path, minilm="embedding")
    deployment = _deploy(
        stack, "structured", [{"model": "chat", "max_batch_size": 8, "max_queue_delay_us": 500}, {"model": "mrl"},
                              {"model": "minilm"}],
    )  # fmt: skip
    _alias(stack, "chat", deployment, "chat")
    _alias(stack, "mrl", deployment, "mrl")
    _alias(stack, "minilm", deployment, "minilm")
    client = _client(stack, _key(stack, all_aliases=True))

    # Embeddings' dimensions: a Matryoshka checkpoint's vectors cut short and made unit length again;
    # refused, saying why, for one whose card names no such training.
    full, short = (client.embeddings.create(model="mrl", input=["a cat"], **extra).data[0].embedding
                   for extra in ({}, {"dimensions": 64}))  # fmt: skip
    assert len(full) == 384 and len(short) == 64
    cut = np.array(full[:64])
    assert np.allclose(short, cut / np.linalg.norm(cut), atol=1e-5)
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="minilm", input=["a cat"], dimensions=64)
    assert refused.value.body["param"] == "dimensions" and "Matryoshka" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="mrl", input=["a cat"], dimensions=385)
    assert "at most 384" in refused.value.body["message"]
    messages = [{"role": "user", "content": "Who is she?"}]

    # A JSON schema from a pydantic model, always parsed by the client's own helper.
    for seed in range(4):
        parsed = client.chat.completions.parse(
            model="chat", messages=messages, response_format=Person, max_tokens=200, temperature=1.0, seed=seed
        )
        person = parsed.choices[0].message.parsed
        assert isinstance(person, Person), parsed.choices[0].message.content
        assert parsed.choices[0].finish_reason == "stop"
    # json_object: any JSON object (its strings and nesting unbounded, so an untrained model
    # usually runs out of tokens inside it: "length"); streamed, the joined deltas are the same.
    asked = {"model": "chat", "messages": messages, "max_tokens": 60, "seed": 3, "temperature": 1.0,
             "response_format": {"type": "json_object"}}  # fmt: skip
    whole = client.chat.completions.create(**asked)
    content = whole.choices[0].message.content
    assert content.startswith("{")
    if whole.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**asked, stream=True))
    assert streamed == content

    # n=3: three choices of one request, each its own; their tokens add up in usage.
    three = client.chat.completions.create(model="chat", messages=messages, n=3, max_tokens=8, temperature=1.0, seed=2)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert len({c.message.content for c in three.choices}) > 1
    assert three.usage.completion_tokens == 24  # an untrained model rarely ends before max_tokens
    chunks = list(client.chat.completions.create(model="chat", messages=messages, n=3, max_tokens=8, temperature=1.0,
                                                 seed=2, stream=True))  # fmt: skip
    texts = defaultdict(str)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[i] for i in range(3)] == [c.message.content for c in three.choices]

    # Log-probabilities: the model's own, checked against its forward pass token by token.
    tokenizer = AutoTokenizer.from_pretrained(chat_llm)
    model = AutoModelForCausalLM.from_pretrained(chat_llm).eval()
    prompt = "Once upon a time"
    completion = client.chat.completions.create(
        model="chat", messages=messages, max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=3
    )
    entries = completion.choices[0].logprobs.content
    assert len(entries) == completion.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in entries)
    for entry in entries:
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)  # greedy: the likeliest
        assert bytes(entry.bytes) == entry.token.encode()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    _check_against_forward_pass(model, tokenizer, tokenizer.encode(rendered), entries)
    legacy = client.completions.create(model="chat", prompt=prompt, max_tokens=6, temperature=0.0, logprobs=2)
    legacy_logprobs = legacy.choices[0].logprobs
    assert len(legacy_logprobs.tokens) == 6 and all(len(top) == 2 for top in legacy_logprobs.top_logprobs)
    assert "".join(legacy_logprobs.tokens) == legacy.choices[0].text
    streamed_entries = [
        entry
        for chunk in client.chat.completions.create(
            model="chat", messages=messages, max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=3, stream=True
        )  # fmt: skip
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed_entries] == [e.token for e in entries]

    # Penalties and logit bias change what greedy decoding picks.
    def greedy_tokens(**extra) -> list[str]:  # noqa: ANN003
        answer = client.chat.completions.create(
            model="chat", messages=messages, max_tokens=24, temperature=0.0, logprobs=True, **extra
        )
        return [e.token for e in answer.choices[0].logprobs.content]

    plain = greedy_tokens()
    penalised = greedy_tokens(presence_penalty=2.0, frequency_penalty=2.0)
    assert len(set(penalised)) == len(penalised)  # nothing generated comes twice
    assert len(set(greedy_tokens(presence_penalty=-2.0, frequency_penalty=-2.0))) < len(set(plain))  # repeats
    first = tokenizer.encode(plain[0])[0]
    assert plain[0] not in greedy_tokens(logit_bias={str(first): -100})

    # Tools: the checkpoint's template renders them; a required call follows its function's schema,
    # is parsed into tool_calls, streams as OpenAI's deltas, and its result goes back in the next turn.
    weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
               "parameters": WEATHER}}  # fmt: skip
    nothing = {"type": "object", "properties": {}, "additionalProperties": False}
    clock = {"type": "function", "function": {"name": "get_time", "parameters": nothing}}
    asked = {"model": "chat", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
             "tools": [weather, clock], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 150,
             "temperature": 1.0, "seed": 4}  # fmt: skip
    called = client.chat.completions.create(**asked)
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    named = client.chat.completions.create(
        **{**asked, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_weather"]
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(**asked, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            entry = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
            entry["arguments"] += delta.function.arguments or ""
    assert list(calls.values()) == [
        {"id": calls[0]["id"], "name": call.function.name, "arguments": call.function.arguments}
    ]
    followed = client.chat.completions.create(
        model="chat", tools=[weather, clock], tool_choice="none", max_tokens=8, seed=1,
        messages=[*asked["messages"], choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}],
    )  # fmt: skip
    assert followed.choices[0].message.content and followed.choices[0].message.tool_calls is None
    assert followed.usage.prompt_tokens > called.usage.prompt_tokens + 10  # the call and its result were rendered
    auto = client.chat.completions.create(**{**asked, "tool_choice": "auto", "max_tokens": 40})
    assert auto.choices[0].message.content or auto.choices[0].message.tool_calls

    # /v1/responses: text, a JSON schema through the SDK's parse helper, function calls and their
    # outputs, and the typed stream events.
    reply = client.responses.create(
        model="chat", input="Hello", instructions="Be brief.", max_output_tokens=10, temperature=0.7
    )
    assert reply.object == "response" and reply.status == "incomplete" and reply.output_text
    assert reply.incomplete_details.reason == "max_output_tokens" and reply.usage.output_tokens == 10
    parsed = client.responses.parse(model="chat", input="Who is she?", text_format=Person, max_output_tokens=200)
    assert isinstance(parsed.output_parsed, Person), parsed.output_text
    asked_tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    called = client.responses.create(model="chat", input="Weather in Oslo?", tools=asked_tools, tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=150, temperature=1.0)  # fmt: skip
    (function_call,) = [item for item in called.output if item.type == "function_call"]
    assert function_call.name == "get_weather" and set(json.loads(function_call.arguments)) == {"city", "unit"}
    answered = client.responses.create(
        model="chat", tools=asked_tools, tool_choice="none", max_output_tokens=8,
        input=[{"role": "user", "content": "Weather in Oslo?"}, function_call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": function_call.call_id, "output": '{"sky": "clear"}'}],
    )  # fmt: skip
    assert answered.output_text and answered.usage.input_tokens > called.usage.input_tokens
    kinds, arguments = [], ""
    with client.responses.stream(model="chat", input="Weather in Oslo?", tools=asked_tools, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=150) as events:  # fmt: skip
        for event in events:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                arguments += event.delta
        final = events.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_item.added" in kinds and "response.function_call_arguments.done" in kinds
    (streamed_call,) = [item for item in final.output if item.type == "function_call"]
    assert streamed_call.arguments == arguments and json.loads(arguments)
    text_kinds = [e.type for e in client.responses.create(model="chat", input="Hi", max_output_tokens=5, stream=True)]
    assert "response.output_text.delta" in text_kinds and "response.output_text.done" in text_kinds
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="chat", input="Hi", store=True)
    assert refused.value.body["param"] == "store"

    # Refusals name the field and the rule.
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="chat", messages=messages, top_logprobs=2)
    assert refused.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="chat", messages=messages,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        )  # fmt: skip
    assert refused.value.body["param"] == "response_format" and "nonsense" in refused.value.body["message"]


def _check_against_forward_pass(model, tokenizer, prompt_ids: list[int], entries) -> None:  # noqa: ANN001
    """Each entry's log-probability is the model's own for one token of that text
    (tokens sharing a text, such as partial UTF-8 bytes, are told apart by it)."""
    by_text = defaultdict(list)
    for token_id in range(len(tokenizer)):
        by_text[tokenizer.decode([token_id])].append(token_id)
    ids = list(prompt_ids)
    for entry in entries:
        with torch.inference_mode():
            row = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
        matches = [t for t in by_text[entry.token] if abs(float(row[t]) - entry.logprob) < 1e-3]
        assert matches, f"{entry.token!r} at {entry.logprob} is not the model's"
        ids.append(matches[0])
