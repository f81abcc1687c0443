"""Streamed text (python_models/gantry_text.py) on three kinds of tokenizer:
byte-level BPE (the demo LLM's: characters split over byte tokens), WordPiece
(MiniLM's: "##" pieces join the word before) and a SentencePiece-style one
(Metaspace: a token's leading space depends on what comes before). The pieces,
one token at a time, are what decoding the whole output at once gives."""

from __future__ import annotations

import random
import sys

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from triton_server.repository import PYTHON_MODELS
from workers.untrained import _byte_level_tokenizer, _minilm

sys.path.insert(0, str(PYTHON_MODELS))
from gantry_text import TextStream  # noqa: E402

TEXTS = [
    "Hello, world! Streaming text, one token at a time.",
    "café naïve résumé — déjà vu; 東京 and 北京 🚀🎉 emoji 👩‍👩‍👧 done.",
    '{"name": "Gantry", "values": [1, 2.5, -3], "ok": true}',
    "  leading spaces,\nnew lines\tand tabs  ",
    "unbelievable playing replayed: words WordPiece splits into ## pieces",
]


def _sentencepiece_style() -> PreTrainedTokenizerFast:
    from tokenizers import SentencePieceBPETokenizer

    tokenizer = SentencePieceBPETokenizer()
    tokenizer.train_from_iterator(TEXTS * 4 + ["the quick brown fox jumps over the lazy dog"] * 4, vocab_size=200)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer._tokenizer)


@pytest.fixture(scope="module", params=["byte-level", "wordpiece", "sentencepiece"])
def tokenizer(request):  # noqa: ANN001, ANN201
    if request.param == "byte-level":
        return _byte_level_tokenizer(_minilm())
    if request.param == "wordpiece":
        return AutoTokenizer.from_pretrained(_minilm())
    return _sentencepiece_style()


def _stream(tokenizer, ids: list[int], stops=()) -> tuple[list[str], TextStream]:  # noqa: ANN001
    stream = TextStream(tokenizer, stops)
    pieces = []
    for token in ids:
        pieces.append(stream.add([token]))
        if stream.stopped:
            break
    pieces.append(stream.finish())
    return pieces, stream


@pytest.mark.parametrize("text", TEXTS)
def test_the_pieces_join_into_the_whole_outputs_text_and_never_end_in_half_a_character(tokenizer, text: str):  # noqa: ANN001
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, stream = _stream(tokenizer, ids)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == whole == stream.text
    assert not any(piece.endswith("\ufffd") for piece in pieces[:-1])


def test_any_tokens_stream_as_they_decode_at_once(tokenizer):  # noqa: ANN001
    """Tokens an untrained model samples: any ids in any order, special ones too."""
    rng = random.Random(7)
    for _ in range(30):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        pieces, _ = _stream(tokenizer, ids)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_a_stop_string_ends_the_text_before_it_and_no_piece_shows_its_start(tokenizer):  # noqa: ANN001
    text = TEXTS[0] + " " + TEXTS[2]
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    for stop in ("world", "one token", '"values"', "2.5", "not in the text"):
        pieces, stream = _stream(tokenizer, ids, stops=[stop, "zzz-unseen"])
        expected = whole[: whole.find(stop)] if stop in whole else whole
        assert "".join(pieces) == expected == stream.text, stop
        assert stream.stopped == (stop in whole)
