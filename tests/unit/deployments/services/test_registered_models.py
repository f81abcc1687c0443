"""Registering checkpoints and recording their inspection."""

from __future__ import annotations

import json

import pytest

from common.errors import PermissionDenied, ValidationFailed
from core.models import Event
from deployments.models import Inspection
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
    assert model.inspection_message == "an embedding model needs its tokenizer files beside config.json"
    assert Event.objects.filter(model=model, kind="model.inspection_failed").exists()


def _inspected(path, **options):  # noqa: ANN001, ANN003, ANN202
    from upstream.checkpoints import inspect_checkpoint

    return inspect_checkpoint(path, roots=[path.parent], **options)


def test_size_counts_the_weights_a_loader_reads_not_a_bin_copy_beside_them(tmp_path):
    folder = factories.write_checkpoint(tmp_path / "ckpt", factories.LLAMA)
    safetensors = (folder / "model.safetensors").stat().st_size
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 10_000)  # the same weights, pickled
    assert _inspected(folder).size_bytes == safetensors
    (folder / "model.safetensors").unlink()
    assert _inspected(folder).size_bytes == 10_000


def test_a_checkpoints_own_sentence_transformers_configuration_is_read(minilm_path):
    found = _inspected(minilm_path).sentence_config
    assert found["modules"] == [
        "sentence_transformers.models.Transformer",
        "sentence_transformers.models.Pooling",
        "sentence_transformers.models.Normalize",
    ]
    assert (found["pooling"], found["normalize"], found["dimension"], found["max_seq_length"]) == (
        "mean",
        True,
        384,
        256,
    )
    assert found["custom_modules"] == []


def test_a_file_that_links_out_of_the_model_roots_is_refused(tmp_path):
    folder = factories.write_checkpoint(tmp_path / "root" / "ckpt", factories.LLAMA)
    (folder / "tokenizer.json").unlink()
    secret = tmp_path / "elsewhere" / "passwd"
    secret.parent.mkdir()
    secret.write_text("root:x:0:0")
    (folder / "tokenizer.json").symlink_to(secret)
    with pytest.raises(ValidationFailed) as refused:
        _inspected(folder)
    assert refused.value.errors["path"] == [
        f"{folder / 'tokenizer.json'} resolves to {secret}, outside the model roots"
    ]


def test_a_config_that_links_out_of_the_roots_is_refused_before_it_is_opened(tmp_path):
    folder = factories.write_checkpoint(tmp_path / "root" / "ckpt", factories.LLAMA)
    (folder / "config.json").unlink()
    # Where the link points does not exist: opened, it would read as "no config.json".
    outside = tmp_path / "elsewhere" / "config.json"
    (folder / "config.json").symlink_to(outside)
    with pytest.raises(ValidationFailed) as refused:
        _inspected(folder)
    assert refused.value.errors["path"] == [f"{folder / 'config.json'} resolves to {outside}, outside the model roots"]


def test_a_sentence_module_of_the_checkpoints_own_code_needs_trust(host, operator, tmp_path, minilm_path):
    import shutil

    folder = tmp_path / "custom"
    shutil.copytree(minilm_path, folder)
    modules = json.loads((folder / "modules.json").read_text())
    modules[1]["type"] = "my_pooling.MyPooling"
    (folder / "modules.json").write_text(json.dumps(modules))
    model = registered_models.model_register(
        name="custom", kind="embedding", path=str(folder), host=host.name, user=operator
    )
    with pytest.raises(ValidationFailed) as refused:
        registered_models.model_inspect(model_id=model.pk, source="test")
    assert refused.value.errors["trust_remote_code"] == [
        "custom needs its own Python code (module my_pooling.MyPooling in modules.json): register it with "
        "trust_remote_code set if you trust that code"
    ]
