"""/api/deployments/: create, validation by field, actions, roles, the GPU plan."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone
from rest_framework.test import APIClient

from core.models import Event
from deployments.models import Deployment, DeploymentModel, DeploymentStatus
from hosts.models import GpuHost


def test_deployments_of_an_offline_host_show_unknown_and_keep_their_status(api, host, minilm):
    created = api.post(
        "/api/deployments/", {"name": "d", "host": "cpu-host", "models": [{"model": "minilm"}]}, format="json"
    )
    api.post(f"/api/deployments/{created.data['id']}/start/")
    GpuHost.objects.filter(pk=host.pk).update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    shown = api.get(f"/api/deployments/{created.data['id']}/").data
    assert (shown["status"], shown["shown_status"]) == ("launching", "unknown")
    [replica] = shown["replica_set"]
    assert (replica["status"], replica["shown_status"], replica["host_online"]) == ("launching", "unknown", False)


def _create(api, **overrides):
    body = {"name": "demo", "host": "cpu-host", "models": [{"model": "minilm"}]}
    body.update(overrides)
    return api.post("/api/deployments/", body, format="json")


def test_replicas_started_get_distinct_ports(api, host, minilm):
    first = _create(api)
    second = _create(api, name="demo-2", replicas=2)
    assert first.status_code == 201, first.data
    assert second.status_code == 201, second.data
    assert (first.data["status"], first.data["replica_set"], first.data["replicas"]) == ("pending", [], 1)
    assert first.data["models"][0]["triton_name"] == "minilm"
    for made in (first, second):
        assert api.post(f"/api/deployments/{made.data['id']}/start/").status_code == 202
    shown = [api.get(f"/api/deployments/{made.data['id']}/").data for made in (first, second)]
    triples = [{r[k] for k in ("http_port", "grpc_port", "metrics_port")} for d in shown for r in d["replica_set"]]
    assert len(triples) == 3 and all(len(t) == 3 for t in triples)
    assert len(set().union(*triples)) == 9
    assert [r["host"] for r in shown[1]["replica_set"]] == ["cpu-host", "cpu-host"]


def test_deployment_of_unknown_model_is_refused(api, host):
    response = _create(api, models=[{"model": "nope"}])
    assert response.status_code == 400
    assert "models[0].model" in response.data["errors"]
    assert "no registered model named 'nope'" in response.data["detail"]
    assert Deployment.objects.count() == 0


def test_deployment_on_unknown_host_is_refused(api, minilm):
    response = _create(api, host="elsewhere")
    assert response.status_code == 400
    assert response.data["errors"] == {"host": ["no GPU host named 'elsewhere' has announced itself"]}


def test_malformed_body_is_refused(api, host, minilm):
    response = api.post("/api/deployments/", "{not json", content_type="application/json")
    assert response.status_code == 400
    assert response.data["detail"].startswith("the body must be JSON: unexpected character")
    assert Deployment.objects.count() == 0


def test_unknown_field_and_bad_values_are_named(api, host, minilm):
    response = _create(api, replica_count=3, replicas=0, models=[{"model": "minilm", "max_batch_size": 0}])
    assert response.status_code == 400
    assert {"replica_count", "replicas"} <= set(response.data["errors"])
    assert "max_batch_size" in response.data["detail"]
    both = _create(api, hosts=["cpu-host"])
    assert both.status_code == 400 and "not both" in both.data["errors"]["host"][0]


def test_bad_name_is_refused_with_the_rule(api, host, minilm):
    response = _create(api, name="Has Spaces")
    assert response.status_code == 400
    assert "lowercase letters" in response.data["detail"]


def test_ports_are_not_asked_for_each_replica_gets_its_own(api, host, minilm):
    response = _create(api, ports={"http": 19000, "grpc": 19001, "metrics": 19002})
    assert response.status_code == 400 and "ports" in response.data["errors"]


def test_start_of_running_deployment_is_refused(api, host, minilm):
    deployment_id = _create(api).data["id"]
    assert api.post(f"/api/deployments/{deployment_id}/start/").status_code == 202
    events_before = Event.objects.count()
    response = api.post(f"/api/deployments/{deployment_id}/start/")
    assert response.status_code == 409
    assert "only a stopped, failed or new deployment can start" in response.data["detail"]
    assert Deployment.objects.get(pk=deployment_id).status == DeploymentStatus.LAUNCHING
    assert Event.objects.count() == events_before


def test_start_of_missing_deployment_is_404(api, host):
    assert api.post("/api/deployments/999/start/").status_code == 404


def test_anonymous_requests_are_refused(db):
    response = APIClient().get("/api/deployments/")
    assert response.status_code == 401 and response["WWW-Authenticate"] == 'Bearer realm="gantry"'
    assert response.json()["code"] == "not_authenticated"


def test_viewer_can_read_but_not_act(viewer, host, minilm, api):
    deployment_id = _create(api).data["id"]
    client = APIClient()
    client.force_authenticate(viewer)
    assert client.get(f"/api/deployments/{deployment_id}/").status_code == 200
    assert client.post(f"/api/deployments/{deployment_id}/start/").status_code == 403
    assert _create(client, name="mine").status_code == 403


def _register(api, path, **extra):  # noqa: ANN001, ANN003, ANN202
    body = {"name": "mini", "kind": "embedding", "path": str(path), "host": "cpu-host", **extra}
    return api.post("/api/models/", body, format="json")


def test_model_still_being_inspected_cannot_be_deployed(api, host, minilm_path):
    _register(api, minilm_path)
    response = _create(api, models=[{"model": "mini"}])
    assert response.status_code == 400
    assert "not inspected yet" in response.data["errors"]["models[0].model"][0]


def test_over_headroom_gpu_plan_is_refused(api, gpu_host, minilm):
    response = _create(
        api,
        host="gpu-host",
        models=[
            {"model": "minilm", "triton_name": "a", "gpu_memory_fraction": 0.6, "gpu_ids": [0]},
            {"model": "minilm", "triton_name": "b", "gpu_memory_fraction": 0.5, "gpu_ids": [0]},
        ],
    )
    assert response.status_code == 400
    assert "above the headroom limit 0.95" in response.data["detail"]


def test_default_priority_level_must_fall_within_the_levels(api, host, minilm):
    response = _create(api, models=[{"model": "minilm", "priority_levels": 2, "default_priority_level": 3}])
    assert response.status_code == 400
    assert "must be between 1 and priority_levels (2)" in response.data["errors"]["models[0].default_priority_level"][0]


def test_plan_shows_memory_per_model_per_gpu(api, gpu_host, minilm):
    created = _create(
        api,
        host="gpu-host",
        models=[
            {"model": "minilm", "triton_name": "a", "gpu_memory_fraction": 0.5},
            {"model": "minilm", "triton_name": "b", "gpu_memory_fraction": 0.25, "gpu_ids": [0]},
            {"model": "minilm", "triton_name": "c", "instance_kind": "KIND_CPU"},
        ],
    )
    assert created.status_code == 201, created.data
    [gpu] = api.get(f"/api/deployments/{created.data['id']}/plan/").data
    assert (gpu["gpu"], gpu["fraction"], gpu["within_headroom"]) == (0, 0.75, True)
    assert [(m["triton_name"], m["bytes"]) for m in gpu["models"]] == [
        ("a", 85_520_809_984 // 2),
        ("b", 85_520_809_984 // 4),
    ]


def test_plan_of_a_cpu_host_is_empty(api, host, minilm):
    created = _create(api)
    assert api.get(f"/api/deployments/{created.data['id']}/plan/").data == []


def test_the_api_says_which_actions_the_deployment_allows_now(api, host, minilm):
    created = _create(api)
    at_rest = {"start": True, "stop": False, "restart": False, "change": True, "rollback": True, "delete": True,
               "scale": True}  # fmt: skip
    assert created.data["actions"] == at_rest
    started = api.post(f"/api/deployments/{created.data['id']}/start/")
    assert started.status_code == 202
    starting = {"start": False, "stop": True, "restart": False, "change": False, "rollback": False, "delete": False,
                "scale": True}  # fmt: skip
    assert started.data["actions"] == starting


def test_an_action_with_a_body_is_refused_by_name(api, host, minilm):
    created = _create(api)
    response = api.post(f"/api/deployments/{created.data['id']}/start/", {"force": True}, format="json")
    assert response.status_code == 400 and response.data["errors"] == {"body": ["must be empty"]}


def test_preflight_draws_the_plan_of_an_unsaved_deployment_and_writes_nothing(api, gpu_host, minilm):
    body = {
        "name": "stack",
        "host": "gpu-host",
        "models": [
            {"model": "minilm", "triton_name": "a", "gpu_memory_fraction": 0.5},
            {"model": "minilm", "triton_name": "b", "gpu_memory_fraction": 0.25, "gpu_ids": [0]},
        ],
    }
    answer = api.post("/api/deployments/preflight/", body, format="json")
    assert answer.status_code == 200, answer.data
    assert (answer.data["valid"], answer.data["errors"]) == (True, {})
    [gpu] = answer.data["plan"]
    assert (gpu["gpu"], gpu["fraction"], gpu["headroom"], gpu["within_headroom"]) == (0, 0.75, 0.95, True)
    assert [(m["triton_name"], m["bytes"]) for m in gpu["models"]] == [
        ("a", 85_520_809_984 // 2),
        ("b", 85_520_809_984 // 4),
    ]
    assert not Deployment.objects.exists() and not DeploymentModel.objects.exists()
    # The same body creates it, and the stored plan is the one the preflight drew.
    created = _create(api, **body)
    assert created.status_code == 201, created.data
    stored = api.get(f"/api/deployments/{created.data['id']}/plan/").data
    drawn = [[(m["triton_name"], m["share"], m["bytes"]) for m in gpu["models"]] for gpu in answer.data["plan"]]
    assert [[(m["triton_name"], m["share"], m["bytes"]) for m in gpu["models"]] for gpu in stored] == drawn


def test_preflight_names_every_broken_rule_and_still_draws_what_passed(api, gpu_host, minilm, operator):
    _create(api, name="taken", host="gpu-host")
    body = {
        "name": "taken",
        "host": "gpu-host",
        "models": [
            {"model": "minilm", "triton_name": "a", "gpu_memory_fraction": 0.7, "gpu_ids": [0]},
            {"model": "minilm", "triton_name": "b", "gpu_memory_fraction": 0.4, "gpu_ids": [0]},
            {"model": "nope"},
        ],
    }
    answer = api.post("/api/deployments/preflight/", body, format="json")
    assert answer.status_code == 200
    assert answer.data["valid"] is False
    assert answer.data["errors"]["name"] == ["a deployment named 'taken' already exists"]
    assert answer.data["errors"]["models[2].model"] == ["no registered model named 'nope'"]
    assert "above the headroom limit 0.95" in answer.data["errors"]["models"][0]
    [gpu] = answer.data["plan"]
    assert (gpu["fraction"], gpu["within_headroom"]) == (1.1, False)
    assert Deployment.objects.count() == 1


def test_preflight_takes_a_blank_name_and_refuses_a_bad_body_by_field(api, gpu_host, minilm):
    answer = api.post(
        "/api/deployments/preflight/", {"host": "gpu-host", "models": [{"model": "minilm"}]}, format="json"
    )
    assert answer.status_code == 200 and answer.data["valid"] is True
    bad = api.post(
        "/api/deployments/preflight/",
        {"host": "gpu-host", "models": [{"model": "minilm", "gpu_memory_fraction": "lots"}]},
        format="json",
    )
    assert bad.status_code == 400
    assert "models[0].gpu_memory_fraction" in bad.data["errors"]
    unknown = api.post(
        "/api/deployments/preflight/", {"host": "nowhere", "models": [{"model": "minilm"}]}, format="json"
    )
    assert unknown.data["errors"] == {"host": ["no GPU host named 'nowhere' has announced itself"]}
    assert unknown.data["plan"] == []


def test_an_integer_beyond_64_bits_is_refused_by_its_bound_not_as_no_integer(api, host, minilm):
    # orjson reads 10**20 as a float; the refusal must still name the field's bound.
    response = api.post(
        "/api/deployments/",
        b'{"name": "huge", "host": "cpu-host", "replicas": 100000000000000000000, "models": [{"model": "minilm"}]}',
        content_type="application/json",
    )
    assert response.status_code == 400
    assert "less than or equal to" in " ".join(response.json()["errors"]["replicas"]), response.json()
