"""Reconcile: each beat, make this host's deployments match what really runs,
without waiting on the broker.

Notices crashed servers (and restarts those that should run), models that are
not ready, launches and stops lost with a dead worker, updates that never finished,
servers that finished loading while no task was waiting for them, and
containers no deployment wants.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from common.errors import InvalidTransition, TransientError
from deployments import states
from deployments.models import Deployment, DesiredState, Event
from deployments.models import DeploymentStatus as S
from deployments.models import Runtime as DeploymentRuntime
from deployments.services import deployments as deployment_services
from deployments.services import hosts
from triton_server.client import Readiness
from triton_server.server import STOP_GRACE_S, LaunchSpec
from workers import nvml
from workers.deploy import telemetry
from workers.deploy.lifecycle import failer, host_lock_held, mark_ready, roll_back
from workers.deploy.plan import launch_spec, load, runtime_for, triton_client
from workers.jobs import run_job, source
from workers.runtimes.base import Runtime
from workers.runtimes.docker import Container, DockerRuntime

log = logging.getLogger(__name__)

# A launch task moves its deployment out of launching within seconds, and a stop
# task ends within the server's grace period plus the wait for its GPU memory;
# a deployment that stays longer lost its task (with its worker, or inside a
# broker that restarted), which is then sent again.
LAUNCH_STALL_S = 60
# Automatic crash restarts are counted over this many minutes (GANTRY_CRASH_RESTART_LIMIT).
CRASH_WINDOW_MIN = 10


def stall_after_s(status: str) -> float:
    if status == S.STOPPING:
        return STOP_GRACE_S + settings.GANTRY_GPU_RELEASE_TIMEOUT + 15
    return LAUNCH_STALL_S


def _recent_crash_restarts(deployment: Deployment) -> int:
    """Automatic restarts in the crash-loop window: the last 10 minutes, or since a
    person last started it (a manual start is a fresh try)."""
    since = timezone.now() - timedelta(minutes=CRASH_WINDOW_MIN)
    started = (
        Event.objects.filter(deployment=deployment, to_status=S.LAUNCHING, source__startswith="user:")
        .order_by("-created_at")
        .values_list("created_at", flat=True)
        .first()
    )
    if started is not None and started > since:
        since = started
    return Event.objects.filter(deployment=deployment, kind="deployment.crash_restart", created_at__gte=since).count()


def relaunch_failed() -> None:
    """A deployment whose crash restarts ran out (its last word is a crash loop) and
    that is still wanted running is started again once its window has room. One
    that failed otherwise (a model that would not load) waits for a person."""
    failed = Deployment.objects.filter(
        host__name=settings.GANTRY_HOST_NAME, status=S.FAILED, desired_state=DesiredState.RUNNING
    )
    for deployment in failed:
        last = (
            Event.objects.filter(deployment=deployment)
            .filter(Q(kind="deployment.crash_loop") | ~Q(to_status=""))
            .order_by("-created_at", "-id")
            .values_list("kind", flat=True)
            .first()
        )
        if last != "deployment.crash_loop":
            continue
        restarts = _recent_crash_restarts(deployment)
        if restarts < settings.GANTRY_CRASH_RESTART_LIMIT:
            with contextlib.suppress(InvalidTransition):
                deployment_services.deployment_relaunch(
                    deployment_id=deployment.pk, source=source(), attempt=restarts + 1
                )


def watch_crashes() -> None:
    """Between beats (every second): fail the serving deployments whose server is
    gone, so a crash is not shown as ready until the next beat."""
    serving = Deployment.objects.select_related("host").filter(
        host__name=settings.GANTRY_HOST_NAME, status__in=states.SERVING
    )
    for deployment in serving:
        _server_gone(deployment, runtime_for(deployment), launch_spec(deployment))


def _server_gone(deployment: Deployment, runtime: Runtime, spec: LaunchSpec) -> bool:
    """Whether the deployment's server no longer runs; a crash is handled here (the
    old server of one being replaced was stopped on purpose: no crash)."""
    if runtime.is_running(deployment.runtime_handle, spec):
        return False
    if not _server_being_replaced(deployment.pk, deployment.status):
        _handle_crash(deployment, runtime, spec)
    return True


def reconcile_host(inventory: nvml.Inventory | None = None) -> None:
    """One pass over this host's deployments that are starting or serving (see the module's docstring)."""
    watched = Deployment.objects.select_related("host").filter(
        host__name=settings.GANTRY_HOST_NAME, status__in=states.SERVING | {S.LAUNCHING, S.STOPPING}
    )
    now = timezone.now()
    for deployment in watched:
        runtime = runtime_for(deployment)
        spec = launch_spec(deployment)
        telemetry.ship_log(deployment, runtime, spec)
        if deployment.status in (S.LAUNCHING, S.STOPPING):
            if (now - deployment.status_changed_at).total_seconds() > stall_after_s(deployment.status):
                _redrive(deployment)
        elif _server_gone(deployment, runtime, spec):
            continue
        elif deployment.status == S.LOADING:
            _check_loading(deployment, runtime, spec, now)
        elif deployment.status == S.UPDATING:
            # Its apply task swaps models in place; one lost with a dead worker is rolled back.
            if (now - deployment.status_changed_at).total_seconds() > settings.GANTRY_TRITON_READY_TIMEOUT + 60:
                _roll_back_stale_update(deployment)
        else:
            _check_models(deployment)
            pids = runtime.pids(deployment.runtime_handle, spec) if spec.gpu_ids else []
            memory = telemetry.process_memory(pids, spec.gpu_ids)
            telemetry.collect_metrics(deployment, inventory, memory=memory)
    _remove_unwanted_containers()


def adopt_servers() -> None:
    """When this worker starts: name on each timeline the servers that kept
    running while no worker watched them (this worker's predecessor died or
    was restarted). Reconcile watches them from now on."""
    active = (
        Deployment.objects.select_related("host")
        .filter(host__name=settings.GANTRY_HOST_NAME, status__in=states.ACTIVE)
        .exclude(runtime_handle="")
    )
    for deployment in active:
        if not runtime_for(deployment).is_running(deployment.runtime_handle, launch_spec(deployment)):
            continue  # gone meanwhile: reconcile reports the crash
        deployment_services.record_deployment_event(
            deployment_id=deployment.pk,
            kind="deployment.adopted",
            source=source(),
            message=f"this host's worker started and adopted the running tritonserver "
            f"({deployment.runtime} {deployment.runtime_handle[:12]}); it kept serving meanwhile",
        )


def _server_being_replaced(deployment_id: int, status: str) -> bool:
    """Whether a generation that needs new folders is replacing the deployment's
    server now: it stops the old one and starts another while the deployment
    stays updating, and records the new handle only once it runs. Its task holds
    the generation lock throughout; the lock dies with a killed task."""
    return status == S.UPDATING and host_lock_held(deployment_id, "generation")


def unwanted_containers(containers: list[Container], active: dict[int, tuple[str, str]]) -> list[Container]:
    """Of ``containers``, those no deployment wants; ``active`` maps each active
    docker deployment of this host to its (runtime handle, status)."""
    unwanted = []
    for container in containers:
        if container.deployment_id in active:
            handle, status = active[container.deployment_id]
            if handle == container.id or not handle:
                continue  # its deployment's server, or one being started right now
            if _server_being_replaced(container.deployment_id, status):
                continue  # the new server, started before its handle is recorded
        unwanted.append(container)
    return unwanted


def _remove_unwanted_containers() -> None:
    """Remove Gantry containers on this host that no deployment wants (any more)."""
    runtime = DockerRuntime(settings.GANTRY_HOST_NAME, settings.GANTRY_DATA_DIR)
    try:
        containers = runtime.containers()
    except TransientError:
        return  # no Docker engine on this host
    active = {
        pk: (handle, status)
        for pk, handle, status in Deployment.objects.filter(
            host__name=settings.GANTRY_HOST_NAME, runtime=DeploymentRuntime.DOCKER, status__in=states.ACTIVE
        ).values_list("pk", "runtime_handle", "status")
    }
    for container in unwanted_containers(containers, active):
        runtime.stop(container.id, grace_s=10)
        hosts.record_host_event(
            host_name=settings.GANTRY_HOST_NAME,
            kind="host.container_removed",
            source=source(),
            message=f"removed container {container.name} ({container.id[:12]}): "
            f"no deployment wants it (deployment {container.deployment_id}, generation {container.generation})",
        )


def _redrive(deployment: Deployment) -> None:
    stall = stall_after_s(deployment.status)
    since = timezone.now() - timedelta(seconds=stall)
    if Event.objects.filter(deployment=deployment, kind="task.redriven", created_at__gte=since).exists():
        return
    try:
        deployment_services.deployment_redrive(
            deployment_id=deployment.pk,
            source=source(),
            message=f"still {deployment.status} after {stall:.0f}s: its task was lost; sending it again",
        )
    except InvalidTransition:
        pass  # it moved on meanwhile


def _readiness(deployment: Deployment) -> Readiness:
    client = triton_client(deployment)
    try:
        return client.readiness([name for p in deployment.placements.all() for name in p.triton_models])
    finally:
        client.close()


def _check_loading(deployment: Deployment, runtime: Runtime, spec: LaunchSpec, now: datetime) -> None:
    """A loading server whose launch task died with its worker: finish the launch's job."""
    state = _readiness(deployment)
    try:
        if state.ready and state.all_models_ready:
            telemetry.report_readiness(deployment, state.models)
            mark_ready(deployment, list(state.models))
        elif (now - deployment.status_changed_at).total_seconds() > settings.GANTRY_TRITON_READY_TIMEOUT:
            tail = runtime.log_tail(deployment.runtime_handle, spec)
            runtime.stop(deployment.runtime_handle, spec)
            deployment_services.deployment_fail(
                deployment_id=deployment.pk,
                reason=f"tritonserver not ready after {settings.GANTRY_TRITON_READY_TIMEOUT}s",
                source=source(),
                only_from=frozenset({S.LOADING}),
                log_tail=tail,
            )
    except InvalidTransition:
        pass  # the launch task got there first


def _handle_crash(deployment: Deployment, runtime: Runtime, spec: LaunchSpec) -> None:
    tail = runtime.log_tail(deployment.runtime_handle, spec)
    ended = runtime.exit_of(deployment.runtime_handle, spec)
    # A crashed container is kept until now for its logs and exit state; remove it before any restart.
    runtime.stop(deployment.runtime_handle, spec)
    deployment_services.deployment_fail(
        deployment_id=deployment.pk,
        reason=f"tritonserver exited unexpectedly: {ended.describe()}",
        source=source(),
        only_from=states.SERVING,
        log_tail=tail,
        server_exit=ended.as_data(),
    )
    if deployment.desired_state != DesiredState.RUNNING:
        return
    restarts = _recent_crash_restarts(deployment)
    if restarts >= settings.GANTRY_CRASH_RESTART_LIMIT:
        deployment_services.record_deployment_event(
            deployment_id=deployment.pk,
            kind="deployment.crash_loop",
            source=source(),
            message=f"not restarting: {restarts} crash restarts in the last {CRASH_WINDOW_MIN} minutes; "
            "it is started again once that window has room, or by a Start",
        )
        return
    try:
        deployment_services.deployment_relaunch(deployment_id=deployment.pk, source=source(), attempt=restarts + 1)
    except InvalidTransition:
        pass


def _check_models(deployment: Deployment) -> None:
    state = _readiness(deployment)
    telemetry.report_readiness(deployment, state.models)
    not_ready = [name for name, ok in state.models.items() if not ok]
    try:
        if not_ready and deployment.status == S.READY:
            states.deployment_transition(
                deployment_id=deployment.pk,
                to=S.DEGRADED,
                source=source(),
                only_from=frozenset({S.READY}),
                message=f"not ready: {', '.join(not_ready)}",
            )
        elif not not_ready and deployment.status == S.DEGRADED:
            states.deployment_transition(
                deployment_id=deployment.pk,
                to=S.READY,
                source=source(),
                only_from=frozenset({S.DEGRADED}),
                message="all models ready again",
            )
    except InvalidTransition:
        pass


def _roll_back_stale_update(deployment: Deployment) -> None:
    """An update whose apply task was lost with its worker: put the last good generation back."""
    run_job(
        f"rollback of generation {deployment.generation}",
        lambda: roll_back(load(deployment.pk), deployment.generation, "the update did not finish in time"),
        fail=failer(deployment.pk, frozenset({S.UPDATING})),
    )
