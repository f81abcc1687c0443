"""Reconcile: lost launches re-driven, crashed servers failed, lost updates rolled back."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from core.models import Event
from deployments import states
from deployments.models import Deployment, DeploymentStatus, Replica
from deployments.services import deployments, replicas
from deployments.services.placements import PlacementSpec
from hosts.models import OutboxMessage
from hosts.services import hosts
from tests import factories
from triton_server.client import TritonClient
from workers import processes
from workers.deploy import lifecycle, reconcile
from workers.runtimes.docker import Container


def _launching_deployment(settings, minilm, operator, age_s: int) -> Deployment:
    host = hosts.host_heartbeat(name=settings.GANTRY_HOST_NAME, gpus=[])
    factories.surveyed()
    deployment = deployments.deployment_create(
        name="stuck", hosts=[host.name], placements=[PlacementSpec(model="minilm")], user=operator
    )
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    OutboxMessage.objects.all().delete()  # sent, and then lost with the worker
    Replica.objects.filter(deployment_id=deployment.pk).update(
        status_changed_at=timezone.now() - timedelta(seconds=age_s)
    )
    return deployment


def test_a_launch_lost_with_its_worker_is_driven_again_once(settings, minilm, operator):
    deployment = _launching_deployment(settings, minilm, operator, age_s=reconcile.LAUNCH_STALL_S + 5)
    reconcile.reconcile_host()
    reconcile.reconcile_host()
    redrives = Event.objects.filter(deployment=deployment, kind="task.redriven")
    assert redrives.count() == 1
    assert Deployment.objects.get(pk=deployment.pk).status == DeploymentStatus.LAUNCHING


def test_a_fresh_launch_is_left_to_its_task(settings, minilm, operator):
    deployment = _launching_deployment(settings, minilm, operator, age_s=1)
    reconcile.reconcile_host()
    assert not Event.objects.filter(deployment=deployment, kind="task.redriven").exists()


def test_a_ready_deployment_whose_server_is_gone_is_marked_failed(settings, minilm, operator):
    deployment = _launching_deployment(settings, minilm, operator, age_s=1)
    source = "worker:test"
    states.replica_transition(
        replica_id=factories.replica_of(deployment).pk, to="loading", source=source, runtime_handle="999999"
    )
    states.replica_transition(replica_id=factories.replica_of(deployment).pk, to="ready", source=source)
    settings.GANTRY_CRASH_RESTART_LIMIT = 0
    reconcile.reconcile_host()
    deployment.refresh_from_db()
    assert deployment.status == DeploymentStatus.FAILED
    # Process 999999 was never this worker's child: how it ended is not known, and the reason says so.
    assert deployment.status_message == (
        "tritonserver exited unexpectedly: exit status unknown (the worker that started it was gone when it ended)"
    )
    assert Event.objects.filter(deployment=deployment, kind="deployment.crash_loop").exists()


def test_an_update_lost_with_its_worker_is_rolled_back(settings, minilm, operator, monkeypatch):
    deployment = _launching_deployment(settings, minilm, operator, age_s=1)
    states.replica_transition(
        replica_id=factories.replica_of(deployment).pk, to="loading", source="t", runtime_handle="1"
    )
    states.replica_transition(replica_id=factories.replica_of(deployment).pk, to="ready", source="t")
    deployments.deployment_change(
        deployment_id=deployment.pk,
        placements=[PlacementSpec(model="minilm", max_batch_size=8)],
        user=operator,
    )
    stale = timezone.now() - timedelta(seconds=settings.GANTRY_TRITON_READY_TIMEOUT + 61)
    Replica.objects.filter(deployment_id=deployment.pk).update(status_changed_at=stale)
    # The server "runs" (the process seam) and the rollback's reload "succeeds" (the Triton client seam).
    monkeypatch.setattr(processes, "is_ours", lambda pid, **markers: True)
    for call in ("load", "unload", "wait_until_ready"):
        monkeypatch.setattr(TritonClient, call, lambda self, *args, **kwargs: None)
    reconcile.reconcile_host()
    deployment.refresh_from_db()
    assert (deployment.status, deployment.generation) == (DeploymentStatus.READY, 1)
    assert deployment.placements.get().max_batch_size == 32
    assert Event.objects.filter(deployment=deployment, kind="deployment.rollback").exists()


def test_a_server_replaced_for_a_generation_is_no_crash_while_its_task_holds_the_lock(settings, minilm, operator):
    """A generation that needs new folders stops the old server and starts another
    while the deployment stays updating; reconcile must not call that a crash
    (it did, between the stop and the new handle). Once no task holds the
    generation lock (it died with its worker), a gone server is a crash again."""
    deployment = _launching_deployment(settings, minilm, operator, age_s=1)
    states.replica_transition(
        replica_id=factories.replica_of(deployment).pk, to="loading", source="t", runtime_handle="999999"
    )
    states.replica_transition(replica_id=factories.replica_of(deployment).pk, to="ready", source="t")
    deployments.deployment_change(
        deployment_id=deployment.pk, placements=[PlacementSpec(model="minilm", max_batch_size=8)], user=operator
    )
    settings.GANTRY_CRASH_RESTART_LIMIT = 0
    replica = factories.replica_of(deployment).pk
    with lifecycle.host_lock(replica, "generation"):
        assert lifecycle.host_lock_held(replica, "generation")
        reconcile.reconcile_host()
        deployment.refresh_from_db()
        assert deployment.status == DeploymentStatus.UPDATING
    assert not lifecycle.host_lock_held(replica, "generation")
    reconcile.reconcile_host()
    deployment.refresh_from_db()
    assert deployment.status == DeploymentStatus.FAILED
    assert deployment.status_message.startswith("tritonserver exited unexpectedly")


def test_the_new_server_of_a_generation_is_kept_until_its_handle_is_recorded(settings):
    """A generation that needs new folders starts its container before it records
    the new handle; reconcile removed that container in between (the server died
    with SIGKILL while it loaded). While the generation's task holds its lock the
    container is kept; without the lock, or for a deployment not updating, a
    container that is not the deployment's server goes."""
    new = Container(id="new", name="gantry-deployment-1-replica-7", deployment_id=1, replica_id=7, generation=3,
                    running=True)  # fmt: skip
    stray = Container(id="stray", name="gantry-deployment-2-replica-8", deployment_id=2, replica_id=8, generation=1,
                      running=True)  # fmt: skip
    served = Container(id="served", name="gantry-deployment-3-replica-9", deployment_id=3, replica_id=9, generation=1,
                       running=True)  # fmt: skip
    active = {7: ("old", DeploymentStatus.UPDATING), 9: ("served", DeploymentStatus.READY)}
    with lifecycle.host_lock(7, "generation"):
        assert reconcile.unwanted_containers([new, stray, served], active) == [stray]
        assert reconcile.unwanted_containers([new], {7: ("old", DeploymentStatus.READY)}) == [new]
    assert reconcile.unwanted_containers([new, stray, served], active) == [new, stray]
    starting = {7: ("", DeploymentStatus.LAUNCHING)}
    assert reconcile.unwanted_containers([new], starting) == []


def _crash_looped(settings, minilm, operator) -> Deployment:  # noqa: ANN001
    deployment = _launching_deployment(settings, minilm, operator, age_s=1)
    states.replica_transition(
        replica_id=factories.replica_of(deployment).pk, to="loading", source="worker:t", runtime_handle="999999"
    )
    states.replica_transition(replica_id=factories.replica_of(deployment).pk, to="ready", source="worker:t")
    settings.GANTRY_CRASH_RESTART_LIMIT = 2
    for attempt in (1, 2):
        Event.objects.create(
            deployment=deployment,
            kind="deployment.crash_restart",
            source="worker:t",
            message=f"automatic restart {attempt} of 2",
        )
    reconcile.watch_crashes()  # between beats: the server is gone
    deployment.refresh_from_db()
    assert deployment.status == DeploymentStatus.FAILED
    loop = Event.objects.get(deployment=deployment, kind="deployment.crash_loop")
    assert "r1 on vm: not restarting: 2 crash restarts in the last 10 minutes" in loop.message
    return deployment


def test_a_crash_loop_is_tried_again_once_its_window_has_room(settings, minilm, operator):
    deployment = _crash_looped(settings, minilm, operator)
    reconcile.relaunch_failed()
    assert Deployment.objects.get(pk=deployment.pk).status == DeploymentStatus.FAILED  # the window is full
    settings.GANTRY_CRASH_RESTART_LIMIT = 3  # the same as the window sliding past one restart
    reconcile.relaunch_failed()
    deployment.refresh_from_db()
    assert deployment.status == DeploymentStatus.LAUNCHING
    assert Event.objects.filter(deployment=deployment, kind="deployment.crash_restart").count() == 3


def test_restarts_older_than_the_window_do_not_count(settings, minilm, operator):
    deployment = _crash_looped(settings, minilm, operator)
    Event.objects.create(
        deployment=deployment,
        kind="deployment.crash_restart",
        source="worker:t",
        created_at=timezone.now() - timedelta(minutes=reconcile.CRASH_WINDOW_MIN + 1),
    )
    assert reconcile._recent_crash_restarts(factories.replica_of(deployment)) == 2


def test_a_manual_start_resets_the_crash_loop_window(settings, minilm, operator):
    deployment = _crash_looped(settings, minilm, operator)
    assert reconcile._recent_crash_restarts(factories.replica_of(deployment)) == 2
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    assert reconcile._recent_crash_restarts(factories.replica_of(deployment)) == 0


def test_a_deployment_that_failed_to_launch_waits_for_a_person(settings, minilm, operator):
    deployment = _launching_deployment(settings, minilm, operator, age_s=1)
    replicas.replica_fail(
        replica_id=factories.replica_of(deployment).pk,
        reason="minilm would not load",
        source="worker:t",
        only_from=frozenset({"launching"}),
    )
    reconcile.relaunch_failed()
    assert Deployment.objects.get(pk=deployment.pk).status == DeploymentStatus.FAILED


def test_a_container_started_before_replicas_is_kept_by_its_handle():
    """An upgrade: the container carries no replica label, but its replica (made by
    the migration) took over its handle."""
    old = Container(id="old", name="gantry-h-deployment-4", deployment_id=4, replica_id=0, generation=2, running=True)
    assert reconcile.unwanted_containers([old], {11: ("old", DeploymentStatus.READY)}) == []
