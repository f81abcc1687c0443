"""/api/models/: registering a checkpoint on its host and its inspection."""

from __future__ import annotations

from rest_framework.test import APIClient

from deployments.models import RegisteredModel
from workers import tasks as worker_tasks


def _register(api, path, **extra):  # noqa: ANN001, ANN003, ANN202
    body = {"name": "mini", "kind": "embedding", "path": str(path), "host": "cpu-host", **extra}
    return api.post("/api/models/", body, format="json")


def test_registered_model_is_inspected_by_its_host(api, host, minilm_path):
    response = _register(api, minilm_path)
    assert response.status_code == 201, response.data
    assert response.data["inspection"] == "pending" and response.data["host"] == "cpu-host"
    worker_tasks.inspect(response.data["id"])
    model = api.get(f"/api/models/{response.data['id']}/").data
    assert model["inspection"] == "ready"
    assert model["architecture"] == "BertModel"
    assert model["hidden_size"] == 384 and model["num_attention_heads"] == 12 and model["head_dim"] == 32
    assert model["parameter_count"] == 22_713_216  # all-MiniLM-L6-v2's safetensors
    assert "tokenizer.json" in model["tokenizer_files"]
    assert len(model["fingerprint"]) == 64


def test_model_in_a_missing_folder_fails_its_inspection(api, host, tmp_path):
    response = _register(api, tmp_path / "none")
    assert response.status_code == 201
    worker_tasks.inspect(response.data["id"])
    model = RegisteredModel.objects.get(pk=response.data["id"])
    assert model.inspection == "failed" and "is not a folder" in model.inspection_message


def test_model_on_unknown_host_is_refused(api, minilm_path):
    response = _register(api, minilm_path, host="nowhere")
    assert response.status_code == 400
    assert "no GPU host named 'nowhere'" in response.data["errors"]["host"][0]
    assert RegisteredModel.objects.count() == 0


def test_register_model_outside_roots_is_refused(api, host, minilm_path, settings):
    settings.GANTRY_MODEL_ROOTS = [minilm_path.parent.parent / "elsewhere"]
    response = _register(api, minilm_path)
    assert response.status_code == 400
    assert "configured model roots" in response.data["errors"]["path"][0]
    assert RegisteredModel.objects.count() == 0


def test_a_hub_model_is_registered_downloaded_to_more_hosts_and_cancelled_through_the_api(api, host, viewer):  # noqa: ANN001
    response = api.post(
        "/api/models/",
        {"name": "hubbed", "kind": "embedding", "host": "cpu-host", "hub_id": "org/tiny", "revision": "v1",
         "allow_patterns": ["*.json", "*.safetensors"]},
        format="json",
    )  # fmt: skip
    assert response.status_code == 201, response.data
    body = response.data
    assert body["path"] == "" and body["hub_id"] == "org/tiny" and body["commit"] == ""
    assert body["allow_patterns"] == ["*.json", "*.safetensors"]
    [download] = body["downloads"]
    assert download["host"] == "cpu-host" and download["status"] == "pending" and download["eta_s"] is None
    refused = api.post(f"/api/models/{body['id']}/downloads/", {"host": "cpu-host"}, format="json")
    assert refused.status_code == 409 and "cpu-host is downloading hubbed already" in refused.data["detail"]
    viewer_api = APIClient()
    viewer_api.force_authenticate(viewer)
    assert viewer_api.post(f"/api/downloads/{download['id']}/cancel/").status_code == 403
    cancelled = api.post(f"/api/downloads/{download['id']}/cancel/")
    assert cancelled.status_code == 202 and cancelled.data["status"] == "cancelled"
    assert api.get(f"/api/models/{body['id']}/").data["downloads"][0]["status"] == "cancelled"


def test_a_folder_model_takes_no_hub_download(api, host, minilm_path):  # noqa: ANN001
    model = _register(api, minilm_path).data
    refused = api.post(f"/api/models/{model['id']}/downloads/", {"host": "cpu-host"}, format="json")
    assert refused.status_code == 409 and "copy it to the same path on cpu-host" in refused.data["detail"]
    unknown = api.post(f"/api/models/{model['id']}/downloads/", {"host": "nowhere", "x": 1}, format="json")
    assert unknown.status_code == 400 and list(unknown.data["errors"]) == ["x"]
