"""Registering checkpoints and recording their inspection."""

from __future__ import annotations

import pytest

from deployments.errors import PermissionDenied, ValidationFailed
from deployments.models import Event, Inspection
from deployments.services import registered_models
from tests import factories
from workers import tasks as worker_tasks


def test_registration_names_every_broken_rule_at_once(host, operator):
    with pytest.raises(ValidationFailed) as refused:
        registered_models.model_register(name="m", kind="vision", path="relative/path", host="nowhere", user=operator)
    assert set(refused.value.errors) == {"kind", "host", "path"}


def test_a_viewer_cannot_register(host, viewer, minilm_path):
    with pytest.raises(PermissionDenied):
        registered_models.model_register(name="m", kind="embedding", path=str(minilm_path), host=host.name, user=viewer)


def test_a_second_delivery_of_the_inspection_leaves_the_first_result(minilm):
    before = Event.objects.filter(model=minilm).count()
    registered_models.model_inspect(model_id=minilm.pk, source="test")
    assert Event.objects.filter(model=minilm).count() == before


def test_a_text_model_without_its_tokenizer_fails_inspection_with_the_reason(host, operator, tmp_path):
    folder = factories.write_checkpoint(tmp_path / "no-tokenizer", {"architectures": ["BertModel"], "hidden_size": 8})
    (folder / "tokenizer.json").unlink()
    model = registered_models.model_register(
        name="bare", kind="embedding", path=str(folder), host=host.name, user=operator
    )
    worker_tasks.inspect(model.pk)
    model.refresh_from_db()
    assert model.inspection == Inspection.FAILED
    assert model.inspection_message == "a embedding model needs its tokenizer files beside config.json"
    assert Event.objects.filter(model=model, kind="model.inspection_failed").exists()
