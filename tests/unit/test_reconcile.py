from datetime import timedelta

from django.utils import timezone

from deployments import services
from deployments.models import Deployment, DeploymentStatus, Event
from workers import deployer


def _launching_deployment(settings, minilm, operator, age_s: int) -> Deployment:
    host = services.host_heartbeat(name=settings.GANTRY_HOST_NAME, gpus=[])
    deployment = services.deployment_create(
        name="stuck", host_name=host.name, placements=[services.PlacementSpec(model="minilm")], user=operator
    )
    services.deployment_start(deployment_id=deployment.pk, user=operator)
    Deployment.objects.filter(pk=deployment.pk).update(status_changed_at=timezone.now() - timedelta(seconds=age_s))
    return deployment


def test_a_launch_lost_with_its_worker_is_driven_again_once(settings, minilm, operator):
    deployment = _launching_deployment(settings, minilm, operator, age_s=deployer.LAUNCH_STALL_S + 5)
    deployer.reconcile_host()
    deployer.reconcile_host()
    redrives = Event.objects.filter(deployment=deployment, kind="deployment.redrive")
    assert redrives.count() == 1
    assert Deployment.objects.get(pk=deployment.pk).status == DeploymentStatus.LAUNCHING


def test_a_fresh_launch_is_left_to_its_task(settings, minilm, operator):
    deployment = _launching_deployment(settings, minilm, operator, age_s=1)
    deployer.reconcile_host()
    assert not Event.objects.filter(deployment=deployment, kind="deployment.redrive").exists()


def test_a_ready_deployment_whose_server_is_gone_is_marked_failed(settings, minilm, operator):
    deployment = _launching_deployment(settings, minilm, operator, age_s=1)
    source = "worker:test"
    services.deployment_transition(deployment_id=deployment.pk, to="loading", source=source, runtime_handle="999999")
    services.deployment_transition(deployment_id=deployment.pk, to="ready", source=source)
    settings.GANTRY_CRASH_RESTART_LIMIT = 0
    deployer.reconcile_host()
    deployment.refresh_from_db()
    assert deployment.status == DeploymentStatus.FAILED
    assert deployment.status_message == "tritonserver exited unexpectedly"
    assert Event.objects.filter(deployment=deployment, kind="deployment.crash_loop").exists()


def test_an_update_lost_with_its_worker_is_rolled_back(settings, minilm, operator, monkeypatch):
    deployment = _launching_deployment(settings, minilm, operator, age_s=1)
    services.deployment_transition(deployment_id=deployment.pk, to="loading", source="t", runtime_handle="1")
    services.deployment_transition(deployment_id=deployment.pk, to="ready", source="t")
    services.deployment_change(
        deployment_id=deployment.pk,
        placements=[services.PlacementSpec(model="minilm", max_batch_size=8)],
        user=operator,
    )
    stale = timezone.now() - timedelta(seconds=settings.GANTRY_TRITON_READY_TIMEOUT + 61)
    Deployment.objects.filter(pk=deployment.pk).update(status_changed_at=stale)
    # The server "runs" and the rollback's reload "succeeds": NVML/Triton are not the point here.
    monkeypatch.setattr(deployer.ProcessRuntime, "is_running", lambda self, handle, spec: True)
    monkeypatch.setattr(deployer, "_swap_models", lambda deployment, spec, specs: {})
    deployer.reconcile_host()
    deployment.refresh_from_db()
    assert (deployment.status, deployment.generation) == (DeploymentStatus.READY, 1)
    assert deployment.placements.get().max_batch_size == 32
    assert Event.objects.filter(deployment=deployment, kind="deployment.rollback").exists()
