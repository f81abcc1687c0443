import pytest

from gateway import schemas
from gateway.errors import GatewayError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _refusal(serializer, body) -> dict:  # noqa: ANN001
    with pytest.raises(GatewayError) as refused:
        schemas.parse(serializer, body)
    assert refused.value.status == 400
    return refused.value.body()["error"]


def test_chat_accepts_text_parts_neutral_fields_and_max_completion_tokens():
    data = schemas.parse(
        schemas.ChatIn,
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],  # noqa: E501
         "n": 1, "presence_penalty": 0, "logprobs": False, "max_completion_tokens": 9, "stop": "END", "user": "u1"},
    )  # fmt: skip
    assert data["messages"][0]["content"] == "ab" and data["max_tokens"] == 9 and data["stop"] == ["END"]


@pytest.mark.parametrize(
    ("body", "param", "rule"),
    [
        ({**CHAT, "n": 2}, "n", "not supported by Gantry's gateway (only 1)"),
        ({**CHAT, "frequency_penalty": 0.5}, "frequency_penalty", "only 0"),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools", "not supported"),
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
    error = _refusal(schemas.ChatIn, body)
    assert error["param"] == param and rule in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_embeddings_and_rerank_bodies():
    assert schemas.parse(schemas.EmbeddingIn, {"model": "e", "input": "x"})["input"] == ["x"]
    assert _refusal(schemas.EmbeddingIn, {"model": "e", "input": [[1, 2, 3]]})["param"] == "input"
    assert _refusal(schemas.EmbeddingIn, {"model": "e", "input": "x", "encoding_format": "int8"})["param"] == (
        "encoding_format"
    )
    assert _refusal(schemas.EmbeddingIn, {"model": "e", "input": "x", "dimensions": 8})["param"] == "dimensions"
    data = schemas.parse(schemas.RerankIn, {"model": "r", "query": "q", "documents": ["a", {"text": "b"}]})
    assert data["documents"] == ["a", "b"] and data["return_documents"] is False
    assert _refusal(schemas.RerankIn, {"model": "r", "query": "q", "documents": [{"body": "b"}]})["param"] == (
        "documents[0]"
    )
    assert _refusal(schemas.RerankIn, {"model": "r", "query": "q", "documents": ["a"], "top_n": 0})["param"] == "top_n"
    assert _refusal(schemas.CompletionIn, {"model": "m", "prompt": ["a", "b"]})["param"] == "prompt"
    assert _refusal(schemas.CompletionIn, [])["code"] == "invalid_body"


def test_one_checker_per_thread_carries_nothing_from_one_body_to_the_next():
    """The checker is built once and reused: a refused body, a nested list and
    defaults leave nothing behind for the next body, in this thread or another."""
    import threading

    long_chat = {**CHAT, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    assert len(schemas.parse(schemas.ChatIn, long_chat)["messages"]) == 2
    assert _refusal(schemas.ChatIn, {**CHAT, "messages": [{"role": "robot", "content": "x"}]})["param"] == (
        "messages[0].role"
    )
    data = schemas.parse(schemas.ChatIn, {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert data["messages"] == [{"role": "user", "content": "hi"}] and data["stream_options"]["include_usage"]
    again = schemas.parse(schemas.ChatIn, CHAT)
    assert again["stream"] is False and "stream_options" not in again and "max_tokens" not in again
    seen = []
    elsewhere = threading.Thread(target=lambda: seen.append(schemas._checker(schemas.ChatIn)))
    elsewhere.start()
    elsewhere.join()
    assert seen[0] is not schemas._checker(schemas.ChatIn) and schemas._checker(schemas.ChatIn) is schemas._checker(
        schemas.ChatIn
    )
