"""Changing a ready deployment: a new generation reloads only what changed,
and a generation that fails to load rolls back to the last good one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from core.models import Event
from deployments.models import Deployment
from tests import factories
from tests.integration.conftest import Stack, wait_for
from tests.integration.test_end_to_end import _socket, _stop, _wait_for_status

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

EMBED = {"model": "minilm", "max_batch_size": 16}
RERANK = {"model": "minilm-rerank"}


def _loads(stack: Stack, deployment_id: int, model: str) -> int:
    replica = factories.replica_row(deployment_id)
    folder = stack.data_dir / "deployments" / f"{deployment_id}-{replica.deployment.name}" / replica.label
    return (folder / "tritonserver.log").read_text().count(f"successfully loaded '{model}'")


@pytest.fixture
def ready_pair(stack: Stack, minilm_path: Path) -> int:
    http = stack.session()
    stack.register_models(minilm_path, minilm="embedding", **{"minilm-rerank": "reranker"})
    created = http.post(
        f"{stack.web_url}/api/deployments/",
        json={"name": "gen", "host": stack.host_name, "models": [EMBED, RERANK]},
        timeout=30,
    ).json()
    with _socket(stack, created["id"]) as socket:
        http.post(f"{stack.web_url}/api/deployments/{created['id']}/start/", timeout=30)
        _wait_for_status(socket, "ready", timeout_s=240)
    yield created["id"]
    _stop(stack, created["id"])


def test_a_new_generation_reloads_only_the_changed_model(stack: Stack, ready_pair: int):
    deployment = factories.replica_row(ready_pair)
    pid = deployment.runtime_handle
    http = stack.session()
    with _socket(stack, ready_pair) as socket:
        changed = http.put(
            f"{stack.web_url}/api/deployments/{ready_pair}/models/",
            json={"models": [{**EMBED, "max_batch_size": 8}, RERANK]},
            timeout=30,
        )
        assert changed.status_code == 202, changed.text
        _wait_for_status(socket, "ready", timeout_s=240)
    deployment.refresh_from_db()
    assert deployment.generation == 2 and deployment.runtime_handle == pid  # same server, changed in place
    client = httpclient.InferenceServerClient(f"127.0.0.1:{deployment.http_port}")
    # Triton swaps in the reloaded model once the old instance has drained.
    wait_for(lambda: client.get_model_config("minilm")["max_batch_size"] == 8, 30, "the reloaded config")
    client.close()
    assert _loads(stack, ready_pair, "minilm") == 2
    assert _loads(stack, ready_pair, "minilm-rerank") == 1  # untouched
    applied = Event.objects.get(deployment_id=ready_pair, kind="deployment.generation_applied")
    assert "loaded ['minilm']" in applied.message and "left as they were ['minilm-rerank']" in applied.message


def test_a_generation_that_fails_to_load_rolls_back(stack: Stack, ready_pair: int, minilm_path: Path, tmp_path: Path):
    broken = tmp_path / "broken"
    shutil.copytree(minilm_path, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    http = stack.session()
    stack.register_models(broken, broken="embedding")
    with _socket(stack, ready_pair) as socket:
        changed = http.put(
            f"{stack.web_url}/api/deployments/{ready_pair}/models/",
            json={"models": [EMBED, RERANK, {"model": "broken"}]},
            timeout=30,
        )
        assert changed.status_code == 202, changed.text
        _wait_for_status(socket, "ready", timeout_s=240)
    deployment = Deployment.objects.get(pk=ready_pair)
    assert deployment.generation == 1
    assert sorted(deployment.placements.values_list("triton_name", flat=True)) == ["minilm", "minilm-rerank"]
    rollback = Event.objects.get(deployment=deployment, kind="deployment.rollback")
    assert "generation 2 failed" in rollback.message
    revisions = http.get(f"{stack.web_url}/api/deployments/{ready_pair}/revisions/", timeout=30).json()["results"]
    assert [(r["generation"], r["status"]) for r in revisions] == [(1, "current"), (2, "failed")]
    # The good models kept serving throughout.
    embedded = http.post(f"{stack.web_url}/api/deployments/{ready_pair}/embed/", json={"texts": ["x"]}, timeout=60)
    assert embedded.status_code == 200
    wait_for(lambda: _loads(stack, ready_pair, "minilm") == 1, 5, "no reload of the unchanged embedder")


def test_restart_roll_back_and_delete_a_real_server(stack: Stack, minilm_path: Path):
    http = stack.session()
    stack.register_models(minilm_path, minilm="embedding")
    created = http.post(
        f"{stack.web_url}/api/deployments/",
        json={"name": "life", "host": stack.host_name, "models": [EMBED]},
        timeout=30,
    ).json()
    url = f"{stack.web_url}/api/deployments/{created['id']}"
    with _socket(stack, created["id"]) as socket:
        http.post(f"{url}/start/", timeout=30)
        _wait_for_status(socket, "ready", timeout_s=240)
        first_server = factories.replica_row(created["id"]).runtime_handle
        assert http.post(f"{url}/restart/", timeout=30).status_code == 202
        seen = _wait_for_status(socket, "ready", timeout_s=240)
        assert [e["to_status"] for e in seen if e["to_status"]] == [
            "stopping",
            "stopped",
            "launching",
            "loading",
            "ready",
        ]
        assert factories.replica_row(created["id"]).runtime_handle not in ("", first_server)

        changed = http.put(f"{url}/models/", json={"models": [{**EMBED, "max_batch_size": 8}]}, timeout=30)
        assert changed.status_code == 202, changed.text
        _wait_for_status(socket, "ready", timeout_s=240)
        rolled = http.post(f"{url}/rollback/", json={"generation": 1}, timeout=30)
        assert rolled.status_code == 202 and rolled.json()["generation"] == 3, rolled.text
        _wait_for_status(socket, "ready", timeout_s=240)
    deployment = factories.replica_row(created["id"])
    client = httpclient.InferenceServerClient(f"127.0.0.1:{deployment.http_port}")
    wait_for(lambda: client.get_model_config("minilm")["max_batch_size"] == 16, 30, "generation 1's config again")
    client.close()

    refused = http.delete(f"{url}/", timeout=30)
    assert refused.status_code == 409 and "stop it before deleting it" in refused.json()["detail"]
    _stop(stack, created["id"])
    folder = stack.data_dir / "deployments" / f"{deployment.deployment_id}-{deployment.deployment.name}"
    assert folder.exists()
    assert http.delete(f"{url}/", timeout=30).status_code == 204
    wait_for(lambda: not folder.exists(), 30, "the host to remove the deleted deployment's files")
    assert http.get(f"{url}/", timeout=30).status_code == 404
    assert Event.objects.filter(kind="deployment.deleted", data__name="life").exists()
