import json

import pytest

from gateway import requests
from gateway.errors import GatewayError
from gateway.requests import ChatRequest, CompletionRequest, EmbeddingRequest, RerankRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _refusal(model, body) -> dict:  # noqa: ANN001
    with pytest.raises(GatewayError) as refused:
        requests.parse(model, body)
    assert refused.value.status == 400
    return refused.value.body()["error"]


def test_chat_accepts_text_parts_neutral_fields_and_max_completion_tokens():
    data = requests.parse(
        ChatRequest,
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],  # noqa: E501
         "n": 1, "presence_penalty": 0, "logprobs": False, "max_completion_tokens": 9, "stop": "END", "user": "u1"},
    )  # fmt: skip
    assert data.messages[0].content == "ab" and data.limit == 9 and data.stop == ["END"]


def test_chat_takes_openais_sampling_extras():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    data = requests.parse(
        ChatRequest,
        {**CHAT, "n": 3, "presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"7": -100, "12": 5.5},
         "logprobs": True, "top_logprobs": 4,
         "response_format": {"type": "json_schema", "json_schema": {"name": "a_b", "schema": schema, "strict": True}}},
    )  # fmt: skip
    assert (data.n, data.presence_penalty, data.frequency_penalty) == (3, 0.5, -1.0)
    assert data.logit_bias == {7: -100.0, 12: 5.5} and data.logprobs_asked == 4
    assert data.guide == ("json_schema", json.dumps(schema))
    assert requests.parse(ChatRequest, {**CHAT, "response_format": {"type": "json_object"}}).guide == ("json", "")
    assert requests.parse(ChatRequest, {**CHAT, "response_format": {"type": "text"}}).guide is None
    assert requests.parse(CompletionRequest, {"model": "m", "prompt": "p", "logprobs": 2}).logprobs_asked == 2


def test_chat_takes_tools_and_their_turns():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    data = requests.parse(
        ChatRequest,
        {**CHAT, "tools": [TOOL], "parallel_tool_calls": False,
         "messages": [{"role": "user", "content": "weather?"},
                      {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]},
    )  # fmt: skip
    assert data.choice == "auto" and data.calls_tools and not data.parallel_tool_calls
    assert data.messages[1].as_sent()["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert data.messages[1].as_sent()["content"] == ""
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert requests.parse(ChatRequest, {**CHAT, "tools": [TOOL], "tool_choice": named}).choice == "get_weather"
    assert not requests.parse(ChatRequest, {**CHAT, "tools": [TOOL], "tool_choice": "none"}).calls_tools


@pytest.mark.parametrize(
    ("body", "param", "rule"),
    [
        ({**CHAT, "n": 17}, "n", "less than or equal to 16"),
        ({**CHAT, "frequency_penalty": 2.5}, "frequency_penalty", "less than or equal to 2"),
        ({**CHAT, "logit_bias": {"a": 1}}, "logit_bias", "keys must be token ids"),
        ({**CHAT, "logit_bias": {"5": 101}}, "logit_bias", "from -100 to 100 (token 5)"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format", "json_schema is given with"),
        ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type", "'text', 'json_object' or"),
        ({**CHAT, "best_of": 2}, "best_of", "only 1"),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools[0].function", "is required"),
        ({**CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope', which is not among tools",
        ),
        ({**CHAT, "tools": [TOOL, TOOL]}, "tools", "a name of its own"),
        (
            {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
            'of type "object"',
        ),
        ({**CHAT, "tools": [TOOL], "response_format": {"type": "json_object"}}, "response_format", "beside tool calls"),
        ({**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "needs tool_call_id"),
        ({**CHAT, "functions": [{"name": "f"}]}, "functions", "not supported"),
        ({**CHAT, "mystery": True}, "mystery", "not supported"),
        ({**CHAT, "top_p": 0}, "top_p", "greater than 0"),
        ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", "1 to 4 strings"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
        ({**CHAT, "max_tokens": 5, "max_completion_tokens": 5}, "max_tokens", "not both"),
        ({"model": "m", "messages": []}, "messages", "may not be empty"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
            "only text parts",
        ),
        ({"messages": CHAT["messages"]}, "model", "required"),
    ],
)
def test_chat_refusals_name_the_parameter(body, param, rule):  # noqa: ANN001
    error = _refusal(ChatRequest, body)
    assert error["param"] == param and rule in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_embeddings_and_rerank_bodies():
    assert requests.parse(EmbeddingRequest, {"model": "e", "input": "x"}).input == ["x"]
    assert _refusal(EmbeddingRequest, {"model": "e", "input": [[1, 2, 3]]})["param"] == "input"
    assert _refusal(EmbeddingRequest, {"model": "e", "input": "x", "encoding_format": "int8"})["param"] == (
        "encoding_format"
    )
    assert _refusal(EmbeddingRequest, {"model": "e", "input": "x", "dimensions": 0})["param"] == "dimensions"
    data = requests.parse(RerankRequest, {"model": "r", "query": "q", "documents": ["a", {"text": "b"}]})
    assert data.documents == ["a", "b"] and data.return_documents is False
    assert _refusal(RerankRequest, {"model": "r", "query": "q", "documents": [{"body": "b"}]})["param"] == (
        "documents[0]"
    )
    assert _refusal(RerankRequest, {"model": "r", "query": "q", "documents": ["a"], "top_n": 0})["param"] == "top_n"
    assert _refusal(CompletionRequest, {"model": "m", "prompt": ["a", "b"]})["param"] == "prompt"
    assert _refusal(CompletionRequest, [])["code"] == "invalid_body"


def test_a_body_is_typed_and_its_defaults_are_filled():
    data = requests.parse(ChatRequest, {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert data.messages[0].as_sent() == {"role": "user", "content": "hi"} and data.include_usage
    again = requests.parse(ChatRequest, CHAT)
    assert again.stream is False and again.include_usage is False and again.limit is None
    named = requests.parse(ChatRequest, {**CHAT, "messages": [{"role": "user", "content": "hi", "name": " ann "}]})
    assert named.messages[0].as_sent() == {"role": "user", "content": "hi", "name": "ann"}
    assert requests.parse(EmbeddingRequest, {"model": " e ", "input": "x"}).model == "e"


@pytest.mark.parametrize(
    ("body", "param", "rule"),
    [
        ({**CHAT, "max_tokens": "8"}, "max_tokens", "valid integer"),
        ({**CHAT, "stream": "true"}, "stream", "valid boolean"),
        ({**CHAT, "temperature": "1"}, "temperature", "valid number"),
        ({**CHAT, "temperature": float("nan")}, "temperature", "finite number"),
        ({**CHAT, "model": " "}, "model", "may not be blank"),
        ({**CHAT, "model": "m" * 129}, "model", "at most 128 characters"),
        ({**CHAT, "model": "m\x00"}, "model", "null characters"),
        ({**CHAT, "user": 5}, "user", "valid string"),
        ({**CHAT, "messages": [{"role": "user"}]}, "messages[0]", "content is required"),
        ({**CHAT, "messages": [{"role": "user", "content": "hi", "extra": 1}]}, "messages[0].extra", "not supported"),
        (
            {**CHAT, "stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
            "boolean",
        ),
    ],
)
def test_json_types_are_kept_and_each_refusal_names_its_field(body, param, rule):  # noqa: ANN001
    """No string is read as a number or a boolean, as OpenAI's API refuses them."""
    error = _refusal(ChatRequest, body)
    assert error["param"] == param and rule in error["message"], error


def test_null_leaves_an_optional_field_unset():
    data = requests.parse(ChatRequest, {**CHAT, "max_tokens": None, "temperature": None, "stop": None, "n": None})
    assert (data.limit, data.temperature, data.stop) == (None, None, None)


@pytest.mark.parametrize(("field", "value"), [("max_tokens", 10**30), ("seed", 2**70)])
def test_an_integer_beyond_64_bits_is_refused_by_its_bound(field, value):
    from common import jsonbody

    body = jsonbody.loads(f'{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "{field}": {value}}}')
    refusal = _refusal(ChatRequest, body)
    assert refusal["param"] == field and "less than or equal to" in refusal["message"], refusal


def test_a_responses_body_becomes_the_chat_request_it_asks_for():
    from gateway.endpoints.responses import ResponsesRequest

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 20, "parallel_tool_calls": False,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1",
             "status": "completed"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
        ],
    }  # fmt: skip
    chat = requests.parse(ResponsesRequest, body).as_chat()
    assert [m.role for m in chat.messages] == ["system", "system", "user", "assistant", "tool"]
    assert chat.messages[2].content == "ab" and [c.id for c in chat.messages[3].tool_calls] == ["c1", "c2"]
    assert chat.messages[4].tool_call_id == "c1" and chat.limit == 20 and chat.choice == "f"
    assert not chat.parallel_tool_calls and chat.tools[0].function.name == "f"
    fmt = {"text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}
    assert requests.parse(ResponsesRequest, {"model": "m", "input": "hi", **fmt}).as_chat().guide[0] == "json_schema"
    assert _refusal(ResponsesRequest, {"model": "m", "input": "hi", "store": True})["param"] == "store"
    assert _refusal(ResponsesRequest, {"model": "m", "input": "hi", "previous_response_id": "r"})["param"] == (
        "previous_response_id"
    )
    assert _refusal(ResponsesRequest, {"model": "m", "input": [{"type": "reasoning"}]})["param"] == "input[0]"
