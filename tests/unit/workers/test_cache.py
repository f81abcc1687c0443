"""A host's hub cache (workers.cache): its quota evicts the least recently used
model, never one pinned or in use there; a model is removed from a host on
request. Real downloads (tests.hubserver) into a real cache on this disk."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.test import override_settings

from common.errors import InvalidTransition, ValidationFailed
from core.models import Event
from deployments import states
from deployments.models import (
    CheckpointCopy,
    DeploymentStatus,
    DownloadStatus,
    ModelDownload,
    RegisteredModel,
    Replica,
)
from deployments.services import deployments, downloads, registered_models
from deployments.services.placements import PlacementSpec
from tests import factories
from tests.hubserver import HubServer, Repo
from tests.unit.workers.test_downloads import _files
from workers import cache
from workers import downloads as worker

pytestmark = pytest.mark.django_db(transaction=True)
MB = 1024 * 1024


@pytest.fixture
def hub(tmp_path: Path, settings):  # noqa: ANN001, ANN201
    factories.cpu_host("home")
    settings.GANTRY_HUB_CACHE = tmp_path / "hub"
    settings.GANTRY_HUB_TOKEN = ""
    settings.GANTRY_HOST_NAME = "home"
    repos = {f"org/{name}": Repo(_files(seed=i)) for i, name in enumerate("abcde")}
    with HubServer(repos) as server:
        settings.GANTRY_HUB_ENDPOINT = server.url
        yield settings


def _fetched(name: str, operator) -> RegisteredModel:  # noqa: ANN001
    model = registered_models.model_register(name=name, kind="embedding", host="home", hub_id=f"org/{name}",
                                             user=operator)  # fmt: skip
    row = ModelDownload.objects.filter(model=model).latest("id")
    worker.run_download(row.pk)
    row.refresh_from_db()
    model.refresh_from_db()
    return model if row.status == DownloadStatus.SUCCEEDED else row  # type: ignore[return-value]


def _held() -> list[str]:
    return sorted(CheckpointCopy.objects.filter(host__name="home").values_list("model__name", flat=True))


def test_the_quota_evicts_the_least_recently_used_and_never_what_is_pinned_or_in_use(hub, operator):  # noqa: ANN001
    hub.GANTRY_HUB_CACHE_QUOTA_GB = 7 * MB / cache.GB  # room for two models of about 3 MB
    a = _fetched("a", operator)
    _fetched("b", operator)
    assert _held() == ["a", "b"]
    _fetched("c", operator)  # a is the least recently used
    assert _held() == ["b", "c"] and not a.folder.exists()
    assert not (hub.GANTRY_HUB_CACHE / "models--org--a").exists()  # its blobs went with it
    gone = Event.objects.get(kind="model.copy_gone", model=a).message
    assert gone == "a's checkpoint on home is gone (evicted, least recently used, to make room for c): " \
        "no replica is placed there"  # fmt: skip
    assert cache.usage(hub.GANTRY_HUB_CACHE) <= 7 * MB

    b = RegisteredModel.objects.get(name="b")
    downloads.copy_pin(model_id=b.pk, host="home", pinned=True, user=operator)
    _fetched("d", operator)  # b is older, but pinned: c goes
    assert _held() == ["b", "d"]

    deployment = deployments.deployment_create(name="uses-d", hosts=["home"], placements=[PlacementSpec(model="d")],
                                               user=operator)  # fmt: skip
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    refused = _fetched("e", operator)
    assert refused.status == DownloadStatus.FAILED
    assert (
        "the hub cache's quota on home (7.0\xa0MB, GANTRY_HUB_CACHE_QUOTA_GB) cannot take e's" in refused.status_message
    )
    assert "in use or pinned here (b, d); nothing was evicted or downloaded" in refused.status_message
    assert _held() == ["b", "d"]


def test_a_hub_model_is_removed_from_a_host_on_request_unless_in_use(hub, operator, tmp_path):  # noqa: ANN001
    model = _fetched("a", operator)
    folder = factories.write_checkpoint(tmp_path / "folder", {"model_type": "bert"})
    local = factories.registered_model(name="local", kind="embedding", path=folder, host=factories.cpu_host("x"))
    with pytest.raises(InvalidTransition, match="Gantry removes only what it downloaded"):
        downloads.copy_remove(model_id=local.pk, host="x", user=operator)
    with pytest.raises(ValidationFailed, match="a folder is never evicted"):
        downloads.copy_pin(model_id=local.pk, host="x", pinned=True, user=operator)

    deployment = deployments.deployment_create(name="uses-a", hosts=["home"], placements=[PlacementSpec(model="a")],
                                               user=operator)  # fmt: skip
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    with pytest.raises(InvalidTransition, match=r"uses-a's r1 use a on home: stop or move them first"):
        downloads.copy_remove(model_id=model.pk, host="home", user=operator)
    deployments.deployment_stop(deployment_id=deployment.pk, user=operator, now=True)
    for replica in Replica.objects.filter(deployment=deployment):  # its host stopped the server
        states.replica_transition(replica_id=replica.pk, to=DeploymentStatus.STOPPED, source="test")
    downloads.copy_remove(model_id=model.pk, host="home", user=operator)
    with override_settings(GANTRY_HOST_NAME="home"):
        cache.remove_asked(model.pk)  # the host's task
    assert _held() == [] and not model.folder.exists()
    assert "removed on request" in Event.objects.get(kind="model.copy_gone", model=model).message
