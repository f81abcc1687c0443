"""What the decoder (python_models/gantry_decode.py) does beyond temperature and
top-p, on the CPU against the model's own forward pass: log-probabilities,
OpenAI's presence and frequency penalties, logit bias, and grammars
(gantry_grammar.py, llguidance) on the byte-level tokenizer of the demo's LLM."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.unit.triton_server.test_decode import Request, llama, prompt
from triton_server.repository import PYTHON_MODELS
from workers.untrained import make_untrained_llm

sys.path.insert(0, str(PYTHON_MODELS))
import gantry_decode  # noqa: E402
import gantry_grammar  # noqa: E402


def run(decoder, requests: list) -> None:
    """Decode ``requests`` together until each has its max_tokens (or its grammar ends)."""
    decoder.admit(list(requests))
    while decoder.rows:
        for request, token, logprobs in decoder.step():
            request.output.append(token)
            request.logprobs_seen.append(logprobs)
        decoder.release(
            [r for r in decoder.rows if len(r.output) >= r.max_tokens or (r.guide is not None and r.guide.stopped)]
        )


@dataclass(eq=False)
class Asked(Request):
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()
    guide: object = None
    logprobs: int | None = None
    logprobs_seen: list = field(default_factory=list)


def forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)


def test_logprobs_are_the_models_own_and_the_top_ones_are_its_likeliest():
    model = llama()
    decoder = gantry_decode.Decoder(model, max_batch=4, max_len=128, pad_id=0)
    asked = [
        Asked(prompt(1, 9), max_tokens=10, temperature=1.0, seed=5, logprobs=3),
        Asked(prompt(2, 5), max_tokens=10, temperature=0.0, logprobs=0),
        Asked(prompt(3, 7), max_tokens=10),
    ]
    run(decoder, asked)
    for request in asked[:2]:
        want = forward_logprobs(model, request.prompt_ids + request.output)
        for step, (token, (chosen, top)) in enumerate(zip(request.output, request.logprobs_seen, strict=True)):
            row = want[len(request.prompt_ids) - 1 + step]
            assert chosen == pytest.approx(float(row[token]), abs=1e-4)
            assert [t for t, _ in top] == row.topk(request.logprobs).indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(row.topk(request.logprobs).values.tolist(), abs=1e-4)
    assert all(seen is None for seen in asked[2].logprobs_seen)


def reference(model, request: Asked) -> list[int]:
    """Greedy decoding with OpenAI's penalties and logit bias, one token at a time."""
    ids, counts = list(request.prompt_ids), torch.zeros(model.config.vocab_size)
    for _ in range(request.max_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        logits = logits - request.frequency_penalty * counts - request.presence_penalty * (counts > 0)
        for token, bias in request.logit_bias:
            logits[token] += bias
        token = int(logits.argmax())
        ids.append(token)
        counts[token] += 1
    return ids[len(request.prompt_ids) :]


def test_presence_and_frequency_penalties_and_logit_bias_match_a_reference_loop():
    model = llama()
    decoder = gantry_decode.Decoder(model, max_batch=4, max_len=128, pad_id=0)
    asked = [
        Asked(prompt(4, 6), max_tokens=16, presence_penalty=1.5, frequency_penalty=0.5),
        Asked(prompt(5, 6), max_tokens=16, frequency_penalty=-0.5, logit_bias=((7, 3.0), (9, -100.0))),
        Asked(prompt(6, 6), max_tokens=16),
    ]
    plain = Asked(prompt(4, 6), max_tokens=16)
    with torch.inference_mode():
        wanted = [reference(model, request) for request in [*asked, plain]]
    run(decoder, asked)
    assert [r.output for r in asked] == wanted[:3]
    assert 9 not in asked[1].output
    assert len(set(wanted[0])) > len(set(wanted[3])), "the penalties change which tokens come"


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    folder = make_untrained_llm(tmp_path_factory.mktemp("bpe") / "llm", tokenizer="bpe")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenizer, AutoModelForCausalLM.from_pretrained(folder).eval()


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}


def test_a_json_schema_holds_for_every_sequence_sampled_beside_free_ones(byte_level):
    tokenizer, model = byte_level
    vocabulary = gantry_grammar.Vocabulary(tokenizer, model.config.vocab_size, {tokenizer.eos_token_id})
    decoder = gantry_decode.Decoder(model, max_batch=8, max_len=512, pad_id=tokenizer.pad_token_id)
    ids = tokenizer.encode("<|im_start|>user\nWho?<|im_end|>\n<|im_start|>assistant\n")
    schema = json.dumps(SCHEMA)
    guided = [
        Asked(ids, max_tokens=120, temperature=1.0, seed=s, guide=vocabulary.guide("json_schema", schema))
        for s in range(5)
    ]
    objects = [Asked(ids, max_tokens=120, temperature=1.0, seed=9, guide=vocabulary.guide("json", ""))]
    free = [Asked(ids, max_tokens=40, temperature=1.0, seed=s) for s in range(2)]
    run(decoder, guided + objects + free)
    for request in guided:
        assert request.guide.stopped
        answer = json.loads(tokenizer.decode(request.output, skip_special_tokens=True))
        assert set(answer) == {"name", "age", "colour"} and 0 <= answer["age"] <= 120 and len(answer["name"]) <= 12
    assert isinstance(json.loads(tokenizer.decode(objects[0].output, skip_special_tokens=True)), dict)
    assert all(len(r.output) == 40 for r in free)
    with pytest.raises(gantry_grammar.GuideError, match="regex"):
        vocabulary.guide("regex", "(")
    with pytest.raises(gantry_grammar.GuideError, match="must be one of"):
        vocabulary.guide("xml", "")


def test_a_wordpiece_tokenizer_is_refused_with_its_reason(tmp_path):
    folder = make_untrained_llm(tmp_path / "wordpiece")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocabulary = gantry_grammar.Vocabulary(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    with pytest.raises(gantry_grammar.GuideError, match="cannot be constrained"):
        vocabulary.guide("json", "")


def test_the_byte_level_tokenizer_round_trips_any_text(byte_level):
    tokenizer, _ = byte_level
    text = 'Ada said {"x": [1, 2.5e-3]} — ünïcode 日本\n\ttabs'
    assert tokenizer.decode(tokenizer.encode(text)) == text
    rng = random.Random(0)
    assert all(tokenizer.convert_tokens_to_ids(t) is not None for t in rng.sample(list(tokenizer.get_vocab()), 50))


def test_a_tokens_logprobs_entry_carries_its_own_bytes_when_it_holds_part_of_a_character(byte_level):
    """OpenAI's ``bytes``: a client joins a character's tokens' bytes into the character."""
    from gantry_text import TokenTexts

    tokenizer, _ = byte_level
    texts = TokenTexts(tokenizer)
    text = "naïve café 日本語"
    ids = tokenizer.encode(text, add_special_tokens=False)
    entries = [texts.entry(i, -1.0) for i in ids]
    assert any(e["token"] == "\ufffd" for e in entries), "some token holds part of a character"
    assert b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8") == text
    assert [e["token"] for e in entries] == [tokenizer.decode([i]) for i in ids]
