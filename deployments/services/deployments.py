"""The deployment lifecycle as people and workers ask for it: create, change
(a new generation), roll back, start, stop, and what a worker reports back
(relaunch after a crash, re-drive a lost launch, fail, notes on the timeline).

Status changes go through deployments.states; work for the host is enqueued
through deployments.queues once the change is committed.

Over 450 lines on purpose: every write that locks a deployment is here, so
the one lock order (the host's row, then the deployment's) and the GPU-plan
check under it can be read in one place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Max, Q

from common.errors import InvalidTransition, NotFound, ValidationFailed
from deployments import events, outbox, queues, selectors, states
from deployments.gpu_plan import Holder, host_plan, plan_problems
from deployments.models import (
    Deployment,
    DeploymentRevision,
    DeploymentStatus,
    DesiredState,
    GpuHost,
    RevisionStatus,
    Runtime,
)
from deployments.permissions import require_operator
from deployments.services.placements import (
    PlacementSpec,
    Resolved,
    placement_from_snapshot,
    placement_rows,
    placements_check,
    placements_snapshot,
    placements_validate,
    placements_write,
    spec_from_snapshot,
)


@dataclass(frozen=True)
class ServerSpec:
    """Settings of a deployment's tritonserver itself; a running server is
    restarted to take a change. Defaults and bounds are Deployment's."""

    shm_size_mib: int = Deployment._meta.get_field("shm_size_mib").get_default()
    log_verbose: int = Deployment._meta.get_field("log_verbose").get_default()


def _server_errors(server: ServerSpec, runtime: str) -> dict[str, list[str]]:
    default = ServerSpec().shm_size_mib
    if runtime != Runtime.DOCKER and server.shm_size_mib != default:
        return {"shm_size_mib": ["the process runtime's server uses the host's /dev/shm: this is the docker runtime's"]}
    return {}


def _allocate_ports(host: GpuHost) -> tuple[int, int, int]:
    """The lowest free triple of ports in the configured range on ``host``."""
    low, high = settings.GANTRY_TRITON_PORT_RANGE
    used: set[int] = set()
    for row in Deployment.objects.filter(host=host).values_list("http_port", "grpc_port", "metrics_port"):
        used.update(row)
    for base in range(low, high - 1, 3):
        triple = (base, base + 1, base + 2)
        if not used.intersection(triple):
            return triple
    raise ValidationFailed({"host": f"no free ports left in GANTRY_TRITON_PORT_RANGE on {host.name}"})


def _create_checks(
    *,
    name: str,
    host_name: str,
    placements: list[PlacementSpec],
    runtime: str,
    image: str,
    ports: tuple[int, int, int] | None,
    server: ServerSpec,
) -> tuple[GpuHost | None, list[Resolved], dict[str, list[str]]]:
    """Every rule a new deployment must pass, each broken one by field; and the
    placements that resolved (on a known host)."""
    errors: dict[str, list[str]] = _server_errors(server, runtime)
    if Deployment.objects.filter(name=name).exists():
        errors["name"] = [f"a deployment named {name!r} already exists"]
    if runtime == Runtime.DOCKER and image not in settings.GANTRY_ALLOWED_IMAGES:
        allowed = ", ".join(settings.GANTRY_ALLOWED_IMAGES) or "none are configured (GANTRY_ALLOWED_IMAGES)"
        errors["image"] = [f"{image or 'an empty image'} is not allow-listed; allowed: {allowed}"]
    if runtime == Runtime.PROCESS and image:
        errors["image"] = ["the process runtime runs the host's own tritonserver; leave image empty"]
    host = GpuHost.objects.filter(name=host_name).first()
    if host is None:
        errors["host"] = [f"no GPU host named {host_name!r} has announced itself"]
        return None, [], errors
    if ports is not None:
        taken = Deployment.objects.filter(host=host).filter(
            Q(http_port__in=ports) | Q(grpc_port__in=ports) | Q(metrics_port__in=ports)
        )
        if len(set(ports)) != 3:
            errors["ports"] = ["http, grpc and metrics ports must differ"]
        elif taken.exists():
            errors["ports"] = [f"one of {list(ports)} is already used by {taken.first().name} on {host.name}"]
    resolved, placement_errors = placements_check(host=host, specs=placements, runtime=runtime, image=image)
    return host, resolved, {**errors, **placement_errors}


def deployment_preflight(
    *,
    name: str,
    host_name: str,
    placements: list[PlacementSpec],
    runtime: str = Runtime.PROCESS,
    image: str = "",
    ports: tuple[int, int, int] | None = None,
    server: ServerSpec = ServerSpec(),
    replaces: int | None = None,
    user: Any = None,
) -> dict[str, Any]:
    """What deployment_create would say, without writing anything: every broken
    rule by field, and the host's GPU plan with the placements that resolved
    beside what its other deployments hold (each model's share of each GPU, the
    headroom, what each share holds). ``replaces``: the deployment a change
    would give these placements, left out of the plan."""
    require_operator(user)
    host, resolved, errors = _create_checks(
        name=name, host_name=host_name, placements=placements, runtime=runtime, image=image, ports=ports,
        server=server,
    )  # fmt: skip
    if host is None:
        return {"valid": not errors, "errors": errors, "plan": [], "warnings": []}
    holders = [
        Holder(key=None, name=name or "this deployment", placements=placement_rows(resolved)),
        *selectors.plan_holders(host, besides=replaces),
    ]
    plans = host_plan(host, holders)
    # What the host holds now would refuse the start, not the creation: said, not refused.
    warnings = [f"at start: {problem}" for problem in plan_problems(plans, own=None)] if not errors else []
    return {"valid": not errors, "errors": errors, "plan": [p.as_dict() for p in plans], "warnings": warnings}


def deployment_create(
    *,
    name: str,
    host_name: str,
    placements: list[PlacementSpec],
    runtime: str = Runtime.PROCESS,
    image: str = "",
    ports: tuple[int, int, int] | None = None,
    server: ServerSpec = ServerSpec(),
    user: Any = None,
) -> Deployment:
    """Create a stopped deployment of one or more models on a host (nothing starts
    yet: the host's GPU plan is checked when it starts)."""
    require_operator(user)
    host, resolved, errors = _create_checks(
        name=name, host_name=host_name, placements=placements, runtime=runtime, image=image, ports=ports,
        server=server,
    )  # fmt: skip
    if errors:
        raise ValidationFailed(errors)
    try:
        with transaction.atomic():
            http_port, grpc_port, metrics_port = ports or _allocate_ports(host)
            deployment = Deployment.objects.create(
                name=name,
                host=host,
                runtime=runtime,
                image=image,
                http_port=http_port,
                grpc_port=grpc_port,
                metrics_port=metrics_port,
                **asdict(server),
                created_by=events.signed_in(user),
            )
            placements_write(deployment=deployment, resolved=resolved)
            DeploymentRevision.objects.create(
                deployment=deployment,
                generation=1,
                spec=placements_snapshot(deployment),
                created_by=deployment.created_by,
            )
            events.record(
                kind="deployment.created",
                source=events.source_of(user),
                actor=user,
                deployment=deployment,
                to_status=deployment.status,
                message=f"created on {host.name} with {', '.join(r.model.name for r in resolved)} "
                f"(ports {http_port}/{grpc_port}/{metrics_port})",
            )
    except IntegrityError as exc:
        # Another request took the name or the ports between our check and insert.
        raise ValidationFailed({"name": f"{name!r} or its ports were taken concurrently; try again"}) from exc
    return deployment


def deployment_change(
    *, deployment_id: int, placements: list[PlacementSpec], user: Any = None, reason: str = ""
) -> Deployment:
    """Give a deployment new placements as a new generation.

    A ready deployment applies it in place (its host reloads only the models
    that changed, and rolls back if the new generation fails to load); one at
    rest takes it at its next start. Refused while it is starting or stopping.
    """
    require_operator(user)
    with transaction.atomic():
        deployment = Deployment.objects.select_related("host").select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        running = deployment.status == DeploymentStatus.READY
        if not states.deployment_actions(deployment.status)["change"]:
            raise InvalidTransition(f"{deployment.name} is {deployment.status}; change it when it is ready or stopped")
        resolved = placements_validate(
            host=deployment.host, specs=placements, runtime=deployment.runtime, image=deployment.image
        )
        if running:
            # Applied now, so it must fit beside whatever else holds the host's GPUs.
            problems = _host_problems(deployment, placement_rows(resolved))
            if problems:
                raise ValidationFailed({"models": problems})
        before = placements_snapshot(deployment)
        placements_write(deployment=deployment, resolved=resolved)
        after = placements_snapshot(deployment)
        if after == before:
            raise ValidationFailed({"models": "this is what the deployment already holds: nothing to change"})
        # After a failed generation was rolled back, its number stays taken by its revision.
        newest = deployment.revisions.aggregate(newest=Max("generation"))["newest"] or 0
        generation = max(deployment.generation, newest) + 1
        Deployment.objects.filter(pk=deployment.pk).update(generation=generation)
        states.revision_supersede_current(deployment_id=deployment.pk)
        DeploymentRevision.objects.create(
            deployment=deployment,
            generation=generation,
            spec=after,
            message=reason,
            created_by=events.signed_in(user),
        )
        events.record(
            kind="deployment.changed",
            source=events.source_of(user),
            actor=user,
            deployment=deployment,
            message=f"generation {generation}: {', '.join(p['triton_name'] for p in after)}"
            + (f" ({reason})" if reason else ""),
            data={"before": before, "after": after, **({"reason": reason} if reason else {})},
        )
        if running:
            deployment = states.deployment_transition(
                deployment_id=deployment.pk,
                to=DeploymentStatus.UPDATING,
                source=events.source_of(user),
                actor=user,
                only_from=frozenset({DeploymentStatus.READY}),
                message=f"applying generation {generation}",
            )
            _enqueue(queues.APPLY_GENERATION, deployment, generation)
    return Deployment.objects.select_related("host").get(pk=deployment_id)


def deployment_rollback(*, deployment_id: int, failed_generation: int, reason: str, source: str) -> Deployment:
    """Put back the placements of the generation before ``failed_generation`` (its host
    then reloads them); the failed revision keeps its reason."""
    with transaction.atomic():
        deployment = Deployment.objects.select_related("host").select_for_update().get(pk=deployment_id)
        if deployment.generation != failed_generation:
            raise InvalidTransition(
                f"{deployment.name} is at generation {deployment.generation}, not {failed_generation}"
            )
        previous = deployment.revisions.filter(status=RevisionStatus.SUPERSEDED).order_by("-generation").first()
        if previous is None:
            raise InvalidTransition(f"{deployment.name} has no earlier generation to roll back to")
        placements_write(deployment=deployment, resolved=[placement_from_snapshot(item) for item in previous.spec])
        Deployment.objects.filter(pk=deployment.pk).update(generation=previous.generation)
        states.revision_transition(
            deployment_id=deployment.pk, generation=failed_generation, to=RevisionStatus.FAILED, message=reason
        )
        states.revision_transition(
            deployment_id=deployment.pk, generation=previous.generation, to=RevisionStatus.CURRENT
        )
        events.record(
            kind="deployment.rollback",
            source=source,
            deployment=deployment,
            message=f"generation {failed_generation} failed ({reason}); back to generation {previous.generation}",
        )
    return Deployment.objects.select_related("host").get(pk=deployment_id)


def deployment_roll_back_to(*, deployment_id: int, generation: int, user: Any = None) -> Deployment:
    """A new generation with the placements of an earlier one (checked again: a
    model or build it named may be gone). The history keeps every generation."""
    require_operator(user)
    deployment = _get_deployment(deployment_id)
    revision = deployment.revisions.filter(generation=generation).first()
    if revision is None:
        raise ValidationFailed({"generation": f"{deployment.name} has no generation {generation}"})
    if generation == deployment.generation:
        raise ValidationFailed({"generation": f"generation {generation} is the one {deployment.name} holds now"})
    specs = [spec_from_snapshot(item) for item in revision.spec]
    return deployment_change(
        deployment_id=deployment_id, placements=specs, user=user, reason=f"rolled back to generation {generation}"
    )


def deployment_restart(*, deployment_id: int, user: Any = None) -> Deployment:
    """Stop the deployment's server and start it again. A failed one is simply
    started; one at rest is refused (start it)."""
    require_operator(user)
    deployment = _get_deployment(deployment_id)
    if deployment.status == DeploymentStatus.FAILED and not deployment.runtime_handle:
        return deployment_start(deployment_id=deployment_id, user=user)
    if deployment.status not in RESTARTABLE:
        raise InvalidTransition(f"{deployment.name} is {deployment.status}; only a running deployment restarts")
    # Stopping with running desired: the stop task starts it again (lifecycle._stop).
    return _ask_stop(
        deployment_id=deployment_id,
        user=user,
        message="restart requested: stopping, then starting again",
        desired_state=DesiredState.RUNNING,
        only_from=RESTARTABLE,
    )


RESTARTABLE = frozenset({DeploymentStatus.READY, DeploymentStatus.DEGRADED, DeploymentStatus.FAILED})


def deployment_start_after_stop(*, deployment_id: int, source: str) -> Deployment | None:
    """The second half of a restart: launch a stopped deployment that should be
    running; None if it is not stopped or no longer wanted running."""
    with transaction.atomic():
        deployment = Deployment.objects.select_related("host").select_for_update().get(pk=deployment_id)
        if deployment.status != DeploymentStatus.STOPPED or deployment.desired_state != DesiredState.RUNNING:
            return None
        deployment = states.deployment_transition(
            deployment_id=deployment_id,
            to=DeploymentStatus.LAUNCHING,
            source=source,
            only_from=frozenset({DeploymentStatus.STOPPED}),
            message="restarting: starting again",
        )
        _enqueue(queues.LAUNCH_DEPLOYMENT, deployment)
    return deployment


def deployment_delete(*, deployment_id: int, user: Any = None) -> None:
    """Delete a deployment at rest: its name and ports are free again, its host
    removes its files, and its timeline stays (the events lose only the link).
    Refused while a server may run or while gateway aliases point at it."""
    require_operator(user)
    with transaction.atomic():
        deployment = Deployment.objects.select_related("host").select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        if deployment.status not in states.AT_REST:
            raise InvalidTransition(f"{deployment.name} is {deployment.status}; stop it before deleting it")
        # The gateway's aliases (gateway.models.Alias) point here by a protected foreign key.
        aliases = sorted(deployment.aliases.values_list("name", flat=True))
        if aliases:
            raise InvalidTransition(
                f"gateway aliases point at {deployment.name}: {', '.join(aliases)}; move or delete them first"
            )
        events.record(
            kind="deployment.deleted",
            source=events.source_of(user),
            actor=user,
            host=deployment.host,
            message=f"{deployment.name} deleted; ports {deployment.http_port}/{deployment.grpc_port}/"
            f"{deployment.metrics_port} are free",
            data={"deployment": deployment.pk, "name": deployment.name, "generation": deployment.generation},
        )
        outbox.enqueue_on_commit(
            queues.FORGET_DEPLOYMENT, host_name=deployment.host.name, args=[deployment.pk, deployment.name]
        )
        deployment.delete()


def _host_problems(deployment: Deployment, rows: list) -> list[str]:
    """What is wrong with the host's GPU plan once ``rows`` (the deployment's
    placements, as they would run) join what the host's other deployments hold.
    The host's row is locked meanwhile, so two starts on one host are checked
    one after the other, each seeing the other."""
    host = GpuHost.objects.select_for_update().get(pk=deployment.host_id)
    holders = [
        Holder(key=deployment.pk, name=deployment.name, placements=rows, status=deployment.status),
        *selectors.plan_holders(host, besides=deployment.pk),
    ]
    return plan_problems(host_plan(host, holders), own=deployment.pk)


def deployment_configure(*, deployment_id: int, server: ServerSpec, user: Any = None) -> Deployment:
    """Change the deployment's server settings (shared memory, log verbosity). A
    deployment at rest takes them at its next start; a running one is restarted."""
    require_operator(user)
    with transaction.atomic():
        deployment = Deployment.objects.select_related("host").select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        errors = _server_errors(server, deployment.runtime)
        if errors:
            raise ValidationFailed(errors)
        before = {name: getattr(deployment, name) for name in asdict(server)}
        if before == asdict(server):
            raise ValidationFailed({"server": "these are the deployment's settings already: nothing to change"})
        if deployment.status not in states.AT_REST and deployment.status not in RESTARTABLE:
            raise InvalidTransition(f"{deployment.name} is {deployment.status}; change it when it is ready or stopped")
        Deployment.objects.filter(pk=deployment.pk).update(**asdict(server))
        events.record(
            kind="deployment.configured",
            source=events.source_of(user),
            actor=user,
            deployment=deployment,
            message="server settings: "
            + ", ".join(f"{k} {before[k]} → {v}" for k, v in asdict(server).items() if before[k] != v),
            data={"before": before, "after": asdict(server)},
        )
    if deployment.status in RESTARTABLE and deployment.runtime_handle:
        return deployment_restart(deployment_id=deployment_id, user=user)
    return Deployment.objects.select_related("host").get(pk=deployment_id)


def _enqueue(task_name: str, deployment: Deployment, *more_args: Any) -> None:
    outbox.enqueue_on_commit(task_name, host_name=deployment.host.name, args=[deployment.pk, *more_args])


def deployment_start(*, deployment_id: int, user: Any = None) -> Deployment:
    """Ask the deployment's host to launch it; refused unless it is at rest."""
    require_operator(user)
    deployment = _get_deployment(deployment_id)
    if deployment.status not in states.sources_of(DeploymentStatus.LAUNCHING):
        raise InvalidTransition(
            f"{deployment.name} is {deployment.status}; only a stopped, failed or new deployment can start"
        )
    with transaction.atomic():
        problems = _host_problems(
            deployment, list(deployment.placements.select_related("registered_model", "engine_build"))
        )
        if problems:
            raise InvalidTransition(f"{deployment.name} does not fit on {deployment.host.name}: {'; '.join(problems)}")
        deployment = states.deployment_transition(
            deployment_id=deployment_id,
            to=DeploymentStatus.LAUNCHING,
            source=events.source_of(user),
            actor=user,
            message=f"start requested; waiting for {deployment.host.name}",
            desired_state=DesiredState.RUNNING,
        )
        _enqueue(queues.LAUNCH_DEPLOYMENT, deployment)
    return deployment


def deployment_stop(*, deployment_id: int, user: Any = None) -> Deployment:
    """Ask the deployment's host to stop its server; refused when nothing runs."""
    require_operator(user)
    deployment = _get_deployment(deployment_id)
    if deployment.status not in states.sources_of(DeploymentStatus.STOPPING):
        raise InvalidTransition(f"{deployment.name} is {deployment.status}; there is nothing to stop")
    return _ask_stop(
        deployment_id=deployment_id, user=user, message="stop requested", desired_state=DesiredState.STOPPED
    )


def _ask_stop(
    *, deployment_id: int, user: Any, message: str, desired_state: str, only_from: frozenset[str] | None = None
) -> Deployment:
    """Move to stopping and send the host its stop task, in one transaction."""
    with transaction.atomic():
        deployment = states.deployment_transition(
            deployment_id=deployment_id,
            to=DeploymentStatus.STOPPING,
            source=events.source_of(user),
            actor=user,
            only_from=only_from,
            message=message,
            desired_state=desired_state,
        )
        _enqueue(queues.STOP_DEPLOYMENT, deployment)
    return deployment


def _get_deployment(deployment_id: int) -> Deployment:
    deployment = Deployment.objects.select_related("host").filter(pk=deployment_id).first()
    if deployment is None:
        raise NotFound(f"deployment {deployment_id} does not exist")
    return deployment


def deployment_relaunch(*, deployment_id: int, source: str, attempt: int) -> Deployment:
    """Restart a failed deployment that should be running (a crashed server)."""
    with transaction.atomic():
        deployment = states.deployment_transition(
            deployment_id=deployment_id,
            to=DeploymentStatus.LAUNCHING,
            source=source,
            only_from=frozenset({DeploymentStatus.FAILED}),
            message=f"restarting after a crash (attempt {attempt})",
        )
        events.record(
            kind="deployment.crash_restart",
            source=source,
            deployment=deployment,
            message=f"automatic restart {attempt} of {settings.GANTRY_CRASH_RESTART_LIMIT}",
        )
        _enqueue(queues.LAUNCH_DEPLOYMENT, deployment)
    return deployment


# What a deployment in a passing state waits for, sent again when it may be lost.
REDRIVEN_TASKS = {
    DeploymentStatus.LAUNCHING: queues.LAUNCH_DEPLOYMENT,
    DeploymentStatus.STOPPING: queues.STOP_DEPLOYMENT,
    DeploymentStatus.UPDATING: queues.APPLY_GENERATION,
}


def deployment_redrive(*, deployment_id: int, source: str, message: str) -> bool:
    """Send a launching, stopping or updating deployment's task again (the first
    was lost with its worker or its broker); False when one still waits in the
    outbox.

    A duplicate is harmless: each of these tasks holds a lock per deployment on
    its host, acts only on a row in the state (and generation) it expects, and
    only one of two racing tasks can move it on.
    """
    with transaction.atomic():
        deployment = Deployment.objects.select_related("host").select_for_update().get(pk=deployment_id)
        task = REDRIVEN_TASKS.get(deployment.status)
        if task is None:
            raise InvalidTransition(f"{deployment.name} is {deployment.status}, not launching, stopping or updating")
        updating = deployment.status == DeploymentStatus.UPDATING
        return outbox.redrive(
            task,
            host_name=deployment.host.name,
            args=[deployment.pk, deployment.generation] if updating else [deployment.pk],
            source=source,
            message=message,
            deployment=deployment,
        )


def record_deployment_event(*, deployment_id: int, kind: str, source: str, message: str) -> None:
    """Note something about a deployment on its timeline without changing its status."""
    with transaction.atomic():
        deployment = _get_deployment(deployment_id)
        events.record(kind=kind, source=source, deployment=deployment, message=message)


def deployment_fail(
    *,
    deployment_id: int,
    reason: str,
    source: str,
    only_from: frozenset[str],
    log_tail: str = "",
    server_exit: dict[str, Any] | None = None,
) -> bool:
    """Mark a deployment failed with ``reason`` (and the server's last log lines,
    and how it exited) if it is still in one of ``only_from``; False when it had
    moved on."""
    data = {key: value for key, value in (("log_tail", log_tail), ("exit", server_exit)) if value}
    try:
        states.deployment_transition(
            deployment_id=deployment_id,
            to=DeploymentStatus.FAILED,
            source=source,
            only_from=only_from,
            runtime_handle="",
            message=reason,
            data=data or None,
        )
    except InvalidTransition:
        return False
    return True


def deployment_server_replaced(*, deployment_id: int, runtime_handle: str) -> bool:
    """Record the new server a deployment being updated now runs on (a container
    restarted for its new generation); False when it is no longer updating."""
    changed = Deployment.objects.filter(pk=deployment_id, status=DeploymentStatus.UPDATING).update(
        runtime_handle=runtime_handle
    )
    return bool(changed)
