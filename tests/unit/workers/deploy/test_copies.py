"""Placement by where the files are: each host's agent records the registered
checkpoints its disk holds (workers.deploy.copies), and a replica goes only to
a host whose copy matches the registered fingerprint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from django.test import override_settings

from common.errors import InvalidTransition
from core.models import Event
from deployments.models import CheckpointCopy, Replica
from deployments.services import deployments, registered_models
from deployments.services.placements import PlacementSpec
from tests import factories
from workers.deploy import copies

pytestmark = pytest.mark.django_db


def _survey(host_name: str) -> None:
    with override_settings(GANTRY_HOST_NAME=host_name):
        copies.survey()


def _held(model_id: int) -> dict[str, bool]:
    return {c.host.name: c.matches for c in CheckpointCopy.objects.filter(model_id=model_id).select_related("model")}


def test_the_host_that_inspects_a_model_holds_it_and_others_hold_it_once_they_find_it(tmp_path: Path, operator):
    home, other = factories.cpu_host("home"), factories.cpu_host("other")
    model = factories.registered_model(
        name="m", kind="embedding", path=factories.write_checkpoint(tmp_path / "m", {"model_type": "bert"}), host=home
    )
    assert _held(model.pk) == {"home": True}
    _survey("other")  # the same path is on "other" (this machine's disk)
    assert _held(model.pk) == {"home": True, "other": True}
    found = Event.objects.filter(kind="model.copy_found", model=model).values_list("message", flat=True)
    assert list(found) == [f"m's checkpoint on other ({model.path}) is found and matches its fingerprint: "
                           "replicas may be placed there"]  # fmt: skip
    _survey("other")  # nothing changed: nothing said again
    assert Event.objects.filter(kind__startswith="model.copy", model=model).count() == 1
    del other


def test_a_copy_is_hashed_again_only_when_its_files_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings):  # noqa: ANN001
    settings.GANTRY_DATA_DIR = tmp_path / "data"
    copies._hashed = None
    home = factories.cpu_host("home")
    folder = factories.write_checkpoint(tmp_path / "m", {"model_type": "bert"})
    model = factories.registered_model(name="m", kind="embedding", path=folder, host=home)
    hashed = []
    real = copies.fingerprint
    monkeypatch.setattr(copies, "fingerprint", lambda root, files: hashed.append(root) or real(root, files))
    _survey("home")
    _survey("home")
    assert len(hashed) == 1
    copies._hashed = None  # a restarted worker: what was hashed is read back from the data folder
    _survey("home")
    assert len(hashed) == 1
    (folder / "config.json").write_text('{"model_type": "bert", "edited": true}')
    _survey("home")
    assert len(hashed) == 2
    assert _held(model.pk) == {"home": False}  # edited: it differs from what was registered
    said = Event.objects.get(kind="model.copy_differs", model=model).message
    assert "differs from the registered files" in said and "no replica is placed there until it matches" in said


def test_a_replica_goes_only_where_the_files_are_and_the_refusal_names_what_each_host_lacks(tmp_path: Path, operator):
    holder, bare = factories.gpu_host("holder"), factories.gpu_host("bare")
    folder = factories.write_checkpoint(tmp_path / "m", {"model_type": "bert"})
    factories.registered_model(name="m", kind="embedding", path=folder, host=holder)
    created = deployments.deployment_create(
        name="d", hosts=[], replicas=2, placements=[PlacementSpec(model="m", gpu_memory_fraction=0.4)], user=operator
    )
    # Spread would put the second replica on "bare": it lacks the files, so both go to "holder".
    deployments.deployment_start(deployment_id=created.pk, user=operator)
    assert sorted(r.host.name for r in Replica.objects.filter(deployment=created)) == ["holder", "holder"]

    pinned = deployments.deployment_create(
        name="p", hosts=[bare.name], placements=[PlacementSpec(model="m")], user=operator
    )
    with pytest.raises(InvalidTransition) as refused:
        deployments.deployment_start(deployment_id=pinned.pk, user=operator)
    assert "bare lacks m's checkpoint: a replica goes only where its files are" in str(refused.value)

    # The folder appears on "bare" (here: its agent finds the same path): it is a candidate.
    _survey("bare")
    deployments.deployment_start(deployment_id=pinned.pk, user=operator)
    assert [r.host.name for r in Replica.objects.filter(deployment=pinned)] == ["bare"]


def test_a_folder_removed_is_forgotten_and_said(tmp_path: Path):
    home = factories.cpu_host("home")
    folder = factories.write_checkpoint(tmp_path / "m", {"model_type": "bert"})
    model = factories.registered_model(name="m", kind="embedding", path=folder, host=home)
    shutil.rmtree(folder)
    _survey("home")
    assert _held(model.pk) == {}
    gone = Event.objects.get(kind="model.copy_gone", model=model)
    assert gone.host.name == "home" and "is gone: no replica is placed there" in gone.message


def test_a_copy_report_for_an_unknown_host_or_model_changes_nothing(tmp_path: Path):
    home = factories.cpu_host("home")
    folder = factories.write_checkpoint(tmp_path / "m", {"model_type": "bert"})
    model = factories.registered_model(name="m", kind="embedding", path=folder, host=home)
    registered_models.checkpoint_copy_record(model_id=model.pk, host_name="nowhere", fingerprint="0" * 64, source="t")
    registered_models.checkpoint_copy_record(model_id=10**9, host_name="home", fingerprint="0" * 64, source="t")
    assert _held(model.pk) == {"home": True}
