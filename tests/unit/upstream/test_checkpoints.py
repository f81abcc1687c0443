"""What a checkpoint's files say of it (upstream/checkpoints.py): a model card
that says its embeddings are Matryoshka ones, the way the hub's cards say it."""

from __future__ import annotations

from pathlib import Path

import pytest

from upstream.checkpoints import sentence_config
from workers.untrained import make_untrained_encoder

CARDS = {
    "tagged": ("---\ntags:\n- sentence-transformers\n- Matryoshka\n---\n# x\n", True),
    "loss": ('Trained with [MatryoshkaLoss](https://...) and\n```json\n{"matryoshka_dims": [768, 256]}\n```', True),
    "plain": ("---\ntags:\n- sentence-transformers\n---\nA sentence embedder.\n", False),
    "mentioned": ("Unlike matryoshka-style models, this one keeps its width.\n", False),
}


@pytest.mark.parametrize("name", CARDS)
def test_a_model_card_names_matryoshka_training_or_not(tmp_path: Path, name: str):
    folder = make_untrained_encoder(tmp_path / "e", kind="embedding")
    card, wanted = CARDS[name]
    (folder / "README.md").write_text(card)
    found = sentence_config(folder)
    assert found["matryoshka"] is wanted and found["dimension"] == 384


def test_the_untrained_embedder_can_be_made_matryoshka(tmp_path: Path):
    assert sentence_config(make_untrained_encoder(tmp_path / "m", kind="embedding", matryoshka=True))["matryoshka"]
    assert not sentence_config(make_untrained_encoder(tmp_path / "p", kind="embedding"))["matryoshka"]
