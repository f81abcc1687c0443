"""Every door's JSON body: parsed by one reader that bounds its nesting, so a deep
body is a 400 naming the rule, never a RecursionError's 500."""

from __future__ import annotations

import asyncio

import pytest

from common import jsonbody
from inference.api import generate_answer

DEEP = b"[" * 5000 + b"]" * 5000


def nested(depth: int) -> bytes:
    return b'{"a":' * (depth - 1) + b"[1]" + b"}" * (depth - 1)


def test_a_body_nested_deeper_than_the_limit_is_refused_naming_the_rule() -> None:
    for raw in (DEEP, nested(jsonbody.MAX_DEPTH + 1)):
        with pytest.raises(jsonbody.InvalidJson, match=f"must not nest deeper than {jsonbody.MAX_DEPTH} levels"):
            jsonbody.loads(raw)


def test_bodies_within_the_limit_parse() -> None:
    assert jsonbody.loads(nested(jsonbody.MAX_DEPTH))["a"]["a"]
    assert jsonbody.loads(b'{"input": ["x"]}') == {"input": ["x"]}
    assert len(jsonbody.loads(b"[" + b",".join([b'"s"'] * 20000) + b"]")) == 20000
    assert jsonbody.loads(b"") is None


def test_a_body_that_is_not_json_says_where() -> None:
    with pytest.raises(jsonbody.InvalidJson, match="must be JSON: unexpected end of data"):
        jsonbody.loads(b"{")


@pytest.mark.parametrize("path", ["/api/deployments/", "/api/models/", "/api/gateway/keys/", "/api/tokens/"])
def test_the_api_refuses_a_deep_body_with_a_400_naming_the_rule(api, path: str) -> None:  # noqa: ANN001
    response = api.post(path, DEEP, content_type="application/json")
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["code"] == "parse_error"
    assert body["detail"] == f"the body must not nest deeper than {jsonbody.MAX_DEPTH} levels"


def test_the_generate_door_refuses_a_deep_body_naming_the_rule() -> None:
    """Both doors of the generate action (the view and the lean token path) parse here first."""
    answer = asyncio.run(generate_answer(1, DEEP, lambda: True, who="test"))
    assert answer.status == 400
    assert answer.body["errors"] == {"body": [f"must not nest deeper than {jsonbody.MAX_DEPTH} levels"]}


def test_integers_beyond_64_bits_stay_integers():
    assert jsonbody.loads(b'{"seed": 1180591620717411303424, "t": 0.5}') == {"seed": 2**70, "t": 0.5}
