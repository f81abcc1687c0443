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
