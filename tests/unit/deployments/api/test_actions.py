"""Restart, roll back to a revision, and delete: what each does to the rows,
and each refusal with its reason."""

from __future__ import annotations

from core.models import Event
from deployments.models import Deployment, DeploymentRevision, EngineBuild, RegisteredModel
from deployments.services import replicas
from gateway.models import Alias
from tests import factories


def _deployment(api, name: str = "d", **placement):  # noqa: ANN001, ANN003
    body = {"name": name, "host": "cpu-host", "models": [{"model": "minilm", **placement}]}
    created = api.post("/api/deployments/", body, format="json")
    assert created.status_code == 201, created.data
    return created.data


def test_restart_stops_with_running_still_desired_then_starts_again(api, host, minilm, operator):  # noqa: ANN001
    made = _deployment(api)
    ready = factories.deployment_in(Deployment.objects.get(pk=made["id"]), "launching", "loading", "ready")
    restarted = api.post(f"/api/deployments/{ready.pk}/restart/")
    assert restarted.status_code == 202
    assert (restarted.data["status"], restarted.data["desired_state"]) == ("stopping", "running")
    factories.deployment_in(ready, "stopped")  # what the host's stop task writes
    replica = factories.replica_of(ready)
    replicas.replica_start_after_stop(replica_id=replica.pk, source="worker:cpu-host")
    replica.refresh_from_db()
    assert replica.status == "launching"
    assert Deployment.objects.get(pk=ready.pk).status == "launching"


def test_a_stop_is_not_followed_by_a_start(api, host, minilm):  # noqa: ANN001
    made = _deployment(api)
    ready = factories.deployment_in(Deployment.objects.get(pk=made["id"]), "launching", "loading", "ready")
    api.post(f"/api/deployments/{ready.pk}/stop/")
    factories.deployment_in(ready, "stopped")
    replicas.replica_start_after_stop(replica_id=factories.replica_of(ready).pk, source="worker:cpu-host")
    assert factories.replica_of(ready).status == "stopped"
    assert Deployment.objects.get(pk=ready.pk).status == "stopped"


def test_restart_of_a_deployment_at_rest_is_refused(api, host, minilm):  # noqa: ANN001
    made = _deployment(api)
    refused = api.post(f"/api/deployments/{made['id']}/restart/")
    assert refused.status_code == 409 and "only a running deployment restarts" in refused.data["detail"]
    assert made["actions"]["restart"] is False and made["actions"]["delete"] is True


def test_roll_back_makes_a_new_generation_with_the_chosen_ones_models(api, host, minilm):  # noqa: ANN001
    made = _deployment(api, max_batch_size=8)
    api.put(
        f"/api/deployments/{made['id']}/models/", {"models": [{"model": "minilm", "max_batch_size": 16}]}, format="json"
    )
    rolled = api.post(f"/api/deployments/{made['id']}/rollback/", {"generation": 1}, format="json")
    assert rolled.status_code == 202, rolled.data
    assert rolled.data["generation"] == 3 and rolled.data["models"][0]["max_batch_size"] == 8
    revisions = DeploymentRevision.objects.filter(deployment_id=made["id"]).order_by("generation")
    assert [r.status for r in revisions] == ["superseded", "superseded", "current"]
    change = Event.objects.filter(deployment_id=made["id"], kind="deployment.changed").latest("id")
    assert "rolled back to generation 1" in change.message


def test_roll_back_to_a_missing_or_the_current_generation_is_refused_by_name(api, host, minilm):  # noqa: ANN001
    made = _deployment(api)
    for generation, rule in ((7, "has no generation 7"), (1, "is the one d holds now")):
        refused = api.post(f"/api/deployments/{made['id']}/rollback/", {"generation": generation}, format="json")
        assert refused.status_code == 400 and rule in refused.data["errors"]["generation"][0]


def test_delete_frees_the_name_and_ports_and_keeps_the_timeline(api, host, minilm):  # noqa: ANN001
    made = _deployment(api)
    row = factories.deployment_in(Deployment.objects.get(pk=made["id"]), "launching", "failed")
    ports = {factories.replica_of(row).http_port}
    timeline = list(Event.objects.filter(deployment_id=made["id"]).values_list("pk", flat=True))
    assert timeline
    assert api.delete(f"/api/deployments/{made['id']}/").status_code == 204
    assert not Deployment.objects.filter(pk=made["id"]).exists()
    assert Event.objects.filter(pk__in=timeline, deployment=None).count() == len(timeline)
    deleted = Event.objects.get(kind="deployment.deleted")
    assert deleted.data["name"] == "d" and "ports on cpu-host are free" in deleted.message
    again = _deployment(api)
    started = factories.deployment_in(Deployment.objects.get(pk=again["id"]), "launching")
    assert {factories.replica_of(started).http_port} == ports


def test_delete_is_refused_while_running_or_named_by_an_alias(api, host, minilm):  # noqa: ANN001
    made = _deployment(api)
    row = Deployment.objects.get(pk=made["id"])
    Alias.objects.create(name="chat", deployment=row, triton_name="minilm")
    refused = api.delete(f"/api/deployments/{made['id']}/")
    assert refused.status_code == 409 and "gateway aliases point at d: chat" in refused.data["detail"]
    Alias.objects.all().delete()
    factories.deployment_in(row, "launching")
    refused = api.delete(f"/api/deployments/{made['id']}/")
    assert refused.status_code == 409 and "stop it before deleting it" in refused.data["detail"]
    assert Deployment.objects.filter(pk=made["id"]).exists()


def test_a_model_in_use_is_not_deleted_and_says_by_what(api, host, minilm):  # noqa: ANN001
    made = _deployment(api)
    refused = api.delete(f"/api/models/{minilm.pk}/")
    assert refused.status_code == 409 and "deployed in d" in refused.data["detail"]
    api.delete(f"/api/deployments/{made['id']}/")
    assert api.delete(f"/api/models/{minilm.pk}/").status_code == 204
    assert not RegisteredModel.objects.filter(pk=minilm.pk).exists()


def test_a_build_is_deleted_only_when_finished_and_not_deployed(api, llama):  # noqa: ANN001
    body = {"model": "llama", "host": "h100-host", "image": factories.IMAGE}
    build = api.post("/api/builds/", body, format="json").data
    refused = api.delete(f"/api/builds/{build['id']}/")
    assert refused.status_code == 409 and "cancel it before deleting it" in refused.data["detail"]
    factories.succeeded_build(EngineBuild.objects.get(pk=build["id"]))
    assert api.delete(f"/api/builds/{build['id']}/").status_code == 204
    assert Event.objects.filter(kind="build.deleted", data__build=build["id"]).exists()


def test_a_viewer_may_not_restart_roll_back_or_delete(host, minilm, api, viewer):  # noqa: ANN001
    from rest_framework.test import APIClient

    made = _deployment(api)
    client = APIClient()
    client.force_authenticate(viewer)
    assert client.post(f"/api/deployments/{made['id']}/restart/").status_code == 403
    assert client.post(f"/api/deployments/{made['id']}/rollback/", {"generation": 1}, format="json").status_code == 403
    assert client.delete(f"/api/deployments/{made['id']}/").status_code == 403
    assert Deployment.objects.filter(pk=made["id"]).exists()
