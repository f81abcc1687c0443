"""Tool calls in the Hermes format (inference/tool_calls.py): the grammar that
holds an answer to its tools (run through llguidance on the demo LLM's
tokenizer, random tokens among those allowed), and reading answers whole and
streamed in pieces of every size."""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch
from transformers import AutoTokenizer

from inference import tool_calls
from triton_server.repository import PYTHON_MODELS
from workers.untrained import TOOLS_CHAT_TEMPLATE, make_untrained_llm

sys.path.insert(0, str(PYTHON_MODELS))
import gantry_grammar  # noqa: E402

WEATHER = tool_calls.Function(
    "get_weather",
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer",
     "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False},
)  # fmt: skip
CLOCK = tool_calls.Function("get_time", {"type": "object", "properties": {}, "additionalProperties": False})
ANSWER = (
    'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "q": {"a": "}"}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_an_answer_is_read_into_content_and_calls():
    content, calls = tool_calls.read(ANSWER)
    assert content == "Let me look."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Oslo", "q": {"a": "}"}}'),
        ("get_time", "{}"),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    broken = 'x <tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'
    assert tool_calls.read(broken) == (broken, [])
    assert tool_calls.read("just text") == ("just text", [])


@pytest.mark.parametrize("seed", range(8))
def test_a_streamed_answer_gives_the_same_content_and_calls_in_any_pieces(seed):
    rng, stream, deltas, at = random.Random(seed), tool_calls.Stream(), [], 0
    while at < len(ANSWER):
        size = rng.randint(1, 7)
        deltas += stream.feed(ANSWER[at : at + size])
        at += size
    deltas += stream.finish()
    content = "".join(d.content for d in deltas if d.content is not None)
    starts = [(d.index, d.name) for d in deltas if d.id is not None]
    arguments: dict[int, str] = {}
    for delta in deltas:
        if delta.arguments is not None:
            arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
    _, whole = tool_calls.read(ANSWER)
    assert content == "Let me look." and starts == [(0, "get_weather"), (1, "get_time")]
    assert arguments == {0: whole[0].arguments, 1: whole[1].arguments}
    first = next(d for d in deltas if d.id is not None).as_openai()
    assert first == {"tool_calls": [{"index": 0, "id": stream.calls[0].id, "type": "function",
                                     "function": {"name": "get_weather", "arguments": ""}}]}  # fmt: skip


def test_text_that_only_looks_like_a_tag_is_content():
    stream = tool_calls.Stream()
    deltas = stream.feed("a <tool") + stream.feed("box> b ") + stream.feed("<to") + stream.finish()
    assert "".join(d.content for d in deltas) == "a <toolbox> b <to"


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory):
    folder = make_untrained_llm(tmp_path_factory.mktemp("bpe") / "llm", tokenizer="bpe")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenizer, gantry_grammar.Vocabulary(tokenizer, len(tokenizer), {tokenizer.eos_token_id})


def _walk(tokenizer, vocabulary, grammar: str, seed: int) -> str:  # noqa: ANN001
    """A random answer among those the grammar allows (an untrained model's)."""
    guide, rng, ids = vocabulary.guide("lark", grammar), random.Random(seed), []
    masks = gantry_grammar.Masks(1, vocabulary.vocab, torch.device("cpu"))
    while not guide.stopped and len(ids) < 400:
        masks.fill([(guide, 0)])
        allowed = gantry_grammar.allowed(masks.host, vocabulary.vocab)[0].nonzero().reshape(-1).tolist()
        token = rng.choice(allowed)
        if token == tokenizer.eos_token_id:
            break
        guide.take(token)
        ids.append(token)
    return tokenizer.decode(ids)


@pytest.mark.parametrize(("choice", "parallel"), [("required", True), ("required", False), ("get_time", True)])
def test_the_grammar_holds_every_call_to_its_functions_schema(vocabulary, choice, parallel):
    tokenizer, vocab = vocabulary
    grammar = tool_calls.grammar([WEATHER, CLOCK], choice=choice, parallel=parallel)
    for seed in range(4):
        content, calls = tool_calls.read(_walk(tokenizer, vocab, grammar, seed))
        assert content is None and calls and (parallel or len(calls) == 1)
        for call in calls:
            arguments = json.loads(call.arguments)
            assert call.name in (("get_time",) if choice == "get_time" else ("get_weather", "get_time"))
            if call.name == "get_weather":
                assert set(arguments) == {"city", "days"} and 1 <= arguments["days"] <= 7


def test_auto_allows_text_or_calls_and_the_template_renders_both_turns(vocabulary):
    tokenizer, vocab = vocabulary
    grammar = tool_calls.grammar([WEATHER], choice="auto", parallel=True)
    answers = [tool_calls.read(_walk(tokenizer, vocab, grammar, seed)) for seed in range(6)]
    assert all(content or calls for content, calls in answers)
    assert tool_calls.reads_tool_calls(TOOLS_CHAT_TEMPLATE) and not tool_calls.reads_tool_calls("{{ messages }}")
