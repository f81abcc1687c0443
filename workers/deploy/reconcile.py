"""Reconcile: each beat, make this host's deployments match what really runs,
without waiting on the broker.

Notices crashed servers (and restarts those that should run), models that are
not ready, launches and stops lost with a dead worker, updates that never finished,
servers that finished loading while no task was waiting for them, and
containers no replica wants.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from common.errors import InvalidTransition, NotFound, TransientError
from core.models import Event
from deployments import states
from deployments.backends import triton_models
from deployments.models import DeploymentStatus as S
from deployments.models import DesiredState, Replica
from deployments.models import Runtime as DeploymentRuntime
from deployments.services import replicas
from hosts.services import hosts
from triton_server.client import Readiness
from triton_server.server import STOP_GRACE_S, LaunchSpec
from workers import exporter, nvml
from workers.deploy import telemetry
from workers.deploy.lifecycle import failer, host_lock_held, mark_ready, roll_back
from workers.deploy.plan import launch_spec, load, runtime_for, triton_client
from workers.jobs import run_job, source
from workers.runtimes.base import Runtime
from workers.runtimes.docker import Container, DockerRuntime

log = logging.getLogger(__name__)

# A launch task moves its replica out of launching within seconds, and a stop
# task ends within the server's grace period plus the wait for its GPU memory;
# a replica that stays longer lost its task (with its worker, or inside a
# broker that restarted), which is then sent again.
LAUNCH_STALL_S = 60
# Automatic crash restarts are counted over this many minutes (GANTRY_CRASH_RESTART_LIMIT).
CRASH_WINDOW_MIN = 10


def stall_after_s(status: str, draining_s: float = 0.0) -> float:
    """How long a replica may stay in ``status`` before its task is taken for
    lost; a stop's drain (``draining_s``, its deadline past its move) counts too."""
    if status == S.STOPPING:
        return draining_s + STOP_GRACE_S + settings.GANTRY_GPU_RELEASE_TIMEOUT + 15
    return LAUNCH_STALL_S


def _draining_s(replica: Replica) -> float:
    if replica.status != S.STOPPING or replica.drain_until is None:
        return 0.0
    return max(0.0, (replica.drain_until - replica.status_changed_at).total_seconds())


def _recent_crash_restarts(replica: Replica) -> int:
    """Automatic restarts in the crash-loop window: the last 10 minutes, or since a
    person last started it (a manual start is a fresh try)."""
    since = timezone.now() - timedelta(minutes=CRASH_WINDOW_MIN)
    started = (
        Event.objects.filter(deployment_id=replica.deployment_id, to_status=S.LAUNCHING, source__startswith="user:")
        .order_by("-created_at")
        .values_list("created_at", flat=True)
        .first()
    )
    if started is not None and started > since:
        since = started
    restarts = Event.objects.filter(deployment_id=replica.deployment_id, kind="deployment.crash_restart")
    return restarts.filter(created_at__gte=since).count()


def relaunch_failed() -> None:
    """A replica whose crash restarts ran out (its last word is a crash loop) and
    that is still wanted running is started again once its window has room. One
    that failed otherwise (a model that would not load) waits for a person."""
    failed = Replica.objects.select_related("deployment", "host").filter(
        host__name=settings.GANTRY_HOST_NAME,
        status=S.FAILED,
        desired_state=DesiredState.RUNNING,
        deployment__desired_state=DesiredState.RUNNING,
    )
    for replica in failed:
        last = (
            Event.objects.filter(deployment_id=replica.deployment_id)
            .filter(Q(kind="deployment.crash_loop") | ~Q(to_status=""))
            .order_by("-created_at", "-id")
            .values_list("kind", flat=True)
            .first()
        )
        if last != "deployment.crash_loop":
            continue
        restarts = _recent_crash_restarts(replica)
        if restarts < settings.GANTRY_CRASH_RESTART_LIMIT:
            with contextlib.suppress(InvalidTransition):
                replicas.replica_relaunch(replica_id=replica.pk, source=source(), attempt=restarts + 1)


def watch_crashes() -> None:
    """Between beats (every second): fail the serving deployments whose server is
    gone, so a crash is not shown as ready until the next beat."""
    serving = Replica.objects.select_related("host", "deployment").filter(
        host__name=settings.GANTRY_HOST_NAME, status__in=states.SERVING
    )
    for replica in serving:
        _server_gone(replica, runtime_for(replica), launch_spec(replica))


def _server_gone(replica: Replica, runtime: Runtime, spec: LaunchSpec) -> bool:
    """Whether the replica's server no longer runs; a crash is handled here (the
    old server of one being replaced was stopped on purpose: no crash)."""
    if runtime.is_running(replica.runtime_handle, spec):
        return False
    if not _server_being_replaced(replica.pk, replica.status):
        _handle_crash(replica, runtime, spec)
    return True


def recover_lost() -> None:
    """This host is back after its replicas were marked lost: each says what its
    server does now (ready, or stopped if it is gone), and its deployment
    converges, stopping the surplus (the oldest generation first)."""
    lost = Replica.objects.select_related("host", "deployment").filter(
        host__name=settings.GANTRY_HOST_NAME, status=S.LOST
    )
    for replica in lost:
        runtime, spec = runtime_for(replica), launch_spec(replica)
        try:
            if replica.runtime_handle and runtime.is_running(replica.runtime_handle, spec):
                states.replica_transition(
                    replica_id=replica.pk, to=S.READY, source=source(), only_from=frozenset({S.LOST}),
                    message="its host is back and its server kept running",
                )  # fmt: skip
            else:
                states.replica_transition(
                    replica_id=replica.pk, to=S.STOPPED, source=source(), only_from=frozenset({S.LOST}),
                    runtime_handle="", message="its host is back; its server is gone",
                )  # fmt: skip
        except InvalidTransition:
            continue
        with contextlib.suppress(InvalidTransition):
            replicas.deployment_converge(deployment_id=replica.deployment_id, source=source())


def reconcile_host(inventory: nvml.Inventory | None = None) -> None:
    """One pass over this host's replicas: lost ones back, then those starting or serving (see above)."""
    recover_lost()
    watched = Replica.objects.select_related("host", "deployment").filter(
        host__name=settings.GANTRY_HOST_NAME, status__in=states.SERVING | {S.LAUNCHING, S.STOPPING}
    )
    now = timezone.now()
    for replica in watched:
        runtime = runtime_for(replica)
        spec = launch_spec(replica)
        telemetry.ship_log(replica, runtime, spec)
        if replica.status in (S.LAUNCHING, S.STOPPING):
            if (now - replica.status_changed_at).total_seconds() > stall_after_s(replica.status, _draining_s(replica)):
                _redrive(replica)
        elif _server_gone(replica, runtime, spec):
            continue
        elif replica.status == S.LOADING:
            _check_loading(replica, runtime, spec, now)
        elif replica.status == S.UPDATING:
            # Its apply task swaps models in place; one lost with a dead worker is rolled back.
            if (now - replica.status_changed_at).total_seconds() > settings.GANTRY_TRITON_READY_TIMEOUT + 60:
                _roll_back_stale_update(replica)
        else:
            _check_models(replica)
            pids = runtime.pids(replica.runtime_handle, spec) if spec.gpu_ids else []
            memory = telemetry.process_memory(pids, spec.gpu_ids)
            telemetry.collect_metrics(replica, inventory, memory=memory, gpu_ids=spec.gpu_ids)
    exporter.forget({replica.pk for replica in watched if replica.status not in (S.LAUNCHING, S.STOPPING)})
    _remove_unwanted_containers()


def adopt_servers() -> None:
    """When this worker starts: name on each timeline the servers that kept
    running while no worker watched them (this worker's predecessor died or
    was restarted). Reconcile watches them from now on."""
    active = (
        Replica.objects.select_related("host", "deployment")
        .filter(host__name=settings.GANTRY_HOST_NAME, status__in=states.ACTIVE)
        .exclude(runtime_handle="")
    )
    for replica in active:
        if not runtime_for(replica).is_running(replica.runtime_handle, launch_spec(replica)):
            continue  # gone meanwhile: reconcile reports the crash
        replicas.record_replica_event(
            replica_id=replica.pk,
            kind="deployment.adopted",
            source=source(),
            message=f"this host's worker started and adopted the running tritonserver "
            f"({replica.deployment.runtime} {replica.runtime_handle[:12]}); it kept serving meanwhile",
        )


def _server_being_replaced(replica_id: int, status: str) -> bool:
    """Whether a generation that needs new folders is replacing the replica's
    server now: it stops the old one and starts another while the replica
    stays updating, and records the new handle only once it runs. Its task holds
    the generation lock throughout; the lock dies with a killed task."""
    return status == S.UPDATING and host_lock_held(replica_id, "generation")


def unwanted_containers(containers: list[Container], active: dict[int, tuple[str, str]]) -> list[Container]:
    """Of ``containers``, those no replica wants; ``active`` maps each active
    docker replica of this host to its (runtime handle, status). A container is
    wanted by its handle too: one started before replicas carries no replica label."""
    handles = {handle for handle, _ in active.values() if handle}
    unwanted = []
    for container in containers:
        if container.id in handles:
            continue
        if container.replica_id in active:
            handle, status = active[container.replica_id]
            if handle == container.id or not handle:
                continue  # its replica's server, or one being started right now
            if _server_being_replaced(container.replica_id, status):
                continue  # the new server, started before its handle is recorded
        unwanted.append(container)
    return unwanted


def _remove_unwanted_containers() -> None:
    """Remove Gantry containers on this host that no replica wants (any more)."""
    runtime = DockerRuntime(settings.GANTRY_HOST_NAME, settings.GANTRY_DATA_DIR)
    try:
        containers = runtime.containers()
    except TransientError:
        return  # no Docker engine on this host
    active = {
        pk: (handle, status)
        for pk, handle, status in Replica.objects.filter(
            host__name=settings.GANTRY_HOST_NAME, deployment__runtime=DeploymentRuntime.DOCKER, status__in=states.ACTIVE
        ).values_list("pk", "runtime_handle", "status")
    }
    for container in unwanted_containers(containers, active):
        runtime.stop(container.id, grace_s=10)
        hosts.record_host_event(
            host_name=settings.GANTRY_HOST_NAME,
            kind="host.container_removed",
            source=source(),
            message=f"removed container {container.name} ({container.id[:12]}): "
            f"no replica wants it (replica {container.replica_id}, generation {container.generation})",
        )


def _redrive(replica: Replica) -> None:
    stall = stall_after_s(replica.status, _draining_s(replica))
    since = timezone.now() - timedelta(seconds=stall)
    redriven = Event.objects.filter(deployment_id=replica.deployment_id, kind="task.redriven", created_at__gte=since)
    if redriven.filter(data__args__0=replica.pk).exists():
        return
    try:
        replicas.replica_redrive(
            replica_id=replica.pk,
            source=source(),
            message=f"still {replica.status} after {stall:.0f}s: its task was lost; sending it again",
        )
    except InvalidTransition:
        pass  # it moved on meanwhile


def _readiness(replica: Replica) -> Readiness:
    client = triton_client(replica)
    try:
        return client.readiness([name for p in replica.deployment.placements.all() for name in triton_models(p)])
    finally:
        client.close()


def _check_loading(replica: Replica, runtime: Runtime, spec: LaunchSpec, now: datetime) -> None:
    """A loading server whose launch task died with its worker: finish the launch's job."""
    state = _readiness(replica)
    try:
        if state.ready and state.all_models_ready:
            telemetry.report_readiness(replica, state.models)
            mark_ready(replica, list(state.models))
        elif (now - replica.status_changed_at).total_seconds() > settings.GANTRY_TRITON_READY_TIMEOUT:
            tail = runtime.log_tail(replica.runtime_handle, spec)
            runtime.stop(replica.runtime_handle, spec)
            replicas.replica_fail(
                replica_id=replica.pk,
                reason=f"tritonserver not ready after {settings.GANTRY_TRITON_READY_TIMEOUT}s",
                source=source(),
                only_from=frozenset({S.LOADING}),
                log_tail=tail,
            )
    except InvalidTransition:
        pass  # the launch task got there first


def _handle_crash(replica: Replica, runtime: Runtime, spec: LaunchSpec) -> None:
    tail = runtime.log_tail(replica.runtime_handle, spec)
    ended = runtime.exit_of(replica.runtime_handle, spec)
    # A crashed container is kept until now for its logs and exit state; remove it before any restart.
    runtime.stop(replica.runtime_handle, spec)
    replicas.replica_fail(
        replica_id=replica.pk,
        reason=f"tritonserver exited unexpectedly: {ended.describe()}",
        source=source(),
        only_from=states.SERVING,
        log_tail=tail,
        server_exit=ended.as_data(),
    )
    if replica.desired_state != DesiredState.RUNNING or replica.deployment.desired_state != DesiredState.RUNNING:
        return
    restarts = _recent_crash_restarts(replica)
    if restarts >= settings.GANTRY_CRASH_RESTART_LIMIT:
        replicas.record_replica_event(
            replica_id=replica.pk,
            kind="deployment.crash_loop",
            source=source(),
            message=f"not restarting: {restarts} crash restarts in the last {CRASH_WINDOW_MIN} minutes; "
            "it is started again once that window has room, or by a Start",
        )
        return
    try:
        replicas.replica_relaunch(replica_id=replica.pk, source=source(), attempt=restarts + 1)
    except (InvalidTransition, NotFound):
        pass  # moved on, or removed (a failed roll's replica)


def _check_models(replica: Replica) -> None:
    state = _readiness(replica)
    telemetry.report_readiness(replica, state.models, state.cause)
    not_ready = [name for name, ok in state.models.items() if not ok]
    try:
        if not_ready and replica.status == S.READY:
            states.replica_transition(
                replica_id=replica.pk,
                to=S.DEGRADED,
                source=source(),
                only_from=frozenset({S.READY}),
                message=f"not ready: {state.cause or ', '.join(not_ready)}",
            )
        elif not not_ready and replica.status == S.DEGRADED:
            states.replica_transition(
                replica_id=replica.pk,
                to=S.READY,
                source=source(),
                only_from=frozenset({S.DEGRADED}),
                message="all models ready again",
            )
    except InvalidTransition:
        pass


def _roll_back_stale_update(replica: Replica) -> None:
    """An update whose apply task was lost with its worker: put the last good generation back."""
    run_job(
        f"rollback of generation {replica.deployment.generation}",
        lambda: roll_back(load(replica.pk), replica.deployment.generation, "the update did not finish in time"),
        fail=failer(replica.pk, frozenset({S.UPDATING})),
    )
