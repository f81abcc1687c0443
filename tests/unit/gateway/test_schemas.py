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


# Values each field may be sent with: within its rules, then beside them or of another JSON type.
_VALUES = {
    "model": (["m", "llm-1"], [" m", "", "m" * 129, 7, None, "m\x00", "\ud800"]),
    "max_tokens": ([1, 16], [0, 32769, 2.0, "8", True, None]),
    "max_completion_tokens": ([9], [0, "9"]),
    "temperature": ([0, 0.5, 2], [2.5, -0.1, "1", False, float("nan")]),
    "top_p": ([1, 0.3], [0, 1.5, "0.5"]),
    "seed": ([0, 42], [-1, 2**63, 3.0]),
    "stop": (["END", ["a", "b"]], [[], ["a"] * 5, ["x" * 65], [1], None]),
    "stream": ([True, False], ["true", 1, None]),
    "stream_options": ([{"include_usage": True}, {}], [{"include_usage": "yes"}, {"other": 1}, [], None]),
    "user": (["u"], ["", "u" * 257, 5]),
    "messages": (
        [
            [{"role": "user", "content": "hi"}],
            [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"}]}],
            [{"role": "user", "content": "hi", "name": "ann"}],
        ],
        [
            [{"role": "robot", "content": "x"}],
            [{"role": "user"}],
            [{"role": "user", "content": "hi", "extra": 1}],
            [{"role": "user", "content": [{"type": "image_url"}]}],
            [],
            "hi",
        ],
    ),
    "prompt": (["hello", ["hello"]], [["a", "b"], [], [1], ""]),
    "input": (["x", ["a", "b"]], [[], [[1, 2]], ["x" * 32_001]]),
    "encoding_format": (["float", "base64"], ["int8", 1]),
    "query": (["q", " q "], ["", "q" * 32_001]),
    "documents": ([["a", {"text": "b"}]], [[], [{"body": "b"}], "a", [1]]),
    "top_n": ([1, 3], [0, "2"]),
    "return_documents": ([True, False], ["no"]),
    "mystery": ([], [1]),
}


def _sent(name: str):  # noqa: ANN202
    """Mostly a value within the field's rules; now and then one beside them."""
    from hypothesis import strategies as st

    good, bad = _VALUES[name]
    return st.sampled_from(good * 6 + bad) if good else st.sampled_from(bad)


@pytest.mark.parametrize("serializer", [schemas.ChatIn, schemas.CompletionIn, schemas.EmbeddingIn, schemas.RerankIn])
def test_the_quick_check_agrees_with_drf_wherever_it_answers(serializer):  # noqa: ANN001
    """Generated bodies: the quick check either defers to DRF or returns exactly what
    DRF's check returns (and DRF accepts the body)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from rest_framework import serializers as drf

    required = {"model", "messages", "prompt", "input", "query", "documents"} & set(serializer._declared_fields)
    optional = {name: _sent(name) for name in [*serializer._declared_fields, "mystery"] if name not in required}
    bodies = st.fixed_dictionaries({name: _sent(name) for name in required}, optional=optional)
    answered = []

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(bodies)
    def agree(body: dict) -> None:
        checker = schemas._checker(serializer)
        try:
            quick = schemas._plain_object(checker, dict(body))
        except schemas._Unsure:
            return
        try:
            full = checker.run_validation(dict(body))
        except drf.ValidationError as exc:
            raise AssertionError(f"the quick check took {body!r}, which DRF refuses: {exc.detail}") from None
        assert quick == dict(full), body
        answered.append(body)

    agree()
    assert answered, "the quick check answered none of the generated bodies"


@pytest.mark.parametrize(("field", "value"), [("max_tokens", 10**30), ("seed", 2**70)])
def test_an_integer_beyond_64_bits_is_refused_by_its_bound(field, value):
    from common import jsonbody

    body = jsonbody.loads(f'{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "{field}": {value}}}')
    refusal = _refusal(schemas.ChatIn, body)
    assert refusal["param"] == field and "less than or equal to" in refusal["message"], refusal
