"""The deployment lifecycle as people and workers ask for it: create, change
(a new generation, rolled replica by replica), roll back, scale, start, stop,
and what a worker reports back about a replica (relaunch after a crash,
re-drive a lost launch, fail, notes on the timeline).

A deployment is its placements and a replica count; each replica is one
Triton on one host, placed here on a host and GPUs with room
(gpu_plan.choose_host). Status changes go through deployments.states; work
for a host is enqueued through hosts.outbox once the change commits.

Over 450 lines on purpose: every write that locks a deployment is here, so
the one lock order (the deployment's row, then its hosts', then its
replicas') and the GPU-plan check under it can be read in one place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import IntegrityError, transaction
from django.db.models import Max

from common.errors import InvalidTransition, NotFound, NothingToChange, ValidationFailed
from core import events, jobs, queues
from core.permissions import require_operator
from deployments import selectors, states
from deployments.gpu_plan import Choice, Holder, host_plan, replica_gpus
from deployments.models import Deployment, DeploymentRevision, DeploymentStatus, DesiredState, PlacementPolicy, Runtime
from deployments.services import replica_placement
from deployments.services import replicas as replicas_service
from deployments.services.autoscale import AUTOSCALE_OFF, AutoscaleSpec, autoscale_errors, describe
from deployments.services.placements import (
    PlacementSpec,
    Resolved,
    placement_rows,
    placements_check,
    placements_snapshot,
    placements_validate,
    placements_write,
    spec_from_snapshot,
)
from hosts import outbox
from hosts.models import GpuHost


@dataclass(frozen=True)
class ServerSpec:
    """Settings of a deployment's tritonserver itself; a running server is
    restarted to take a change, except the drain timeout (read at each stop).
    Defaults and bounds are Deployment's."""

    shm_size_mib: int = Deployment._meta.get_field("shm_size_mib").get_default()
    log_verbose: int = Deployment._meta.get_field("log_verbose").get_default()
    drain_timeout_s: int = Deployment._meta.get_field("drain_timeout_s").get_default()

    def restarts(self, before: dict[str, Any]) -> bool:
        """Whether going from ``before`` to these settings needs a new server."""
        return any(before[name] != value for name, value in asdict(self).items() if name != "drain_timeout_s")


def _server_errors(server: ServerSpec, runtime: str) -> dict[str, list[str]]:
    default = ServerSpec().shm_size_mib
    if runtime != Runtime.DOCKER and server.shm_size_mib != default:
        return {"shm_size_mib": ["the process runtime's server uses the host's /dev/shm: this is the docker runtime's"]}
    return {}


def _create_checks(
    *,
    name: str,
    hosts: list[str],
    placements: list[PlacementSpec],
    runtime: str,
    image: str,
    server: ServerSpec,
    replicas: int,
    placement_policy: str,
    autoscale: AutoscaleSpec,
) -> tuple[GpuHost | None, list[GpuHost], list[Resolved], dict[str, list[str]]]:
    """Every rule a new deployment must pass, each broken one by field; the host
    its placements are checked against (its first pinned host, else the online
    host with the most GPUs), its pinned hosts, and the placements that resolved."""
    errors: dict[str, list[str]] = _server_errors(server, runtime)
    if Deployment.objects.filter(name=name).exists():
        errors["name"] = [f"a deployment named {name!r} already exists"]
    if runtime == Runtime.DOCKER and image not in settings.GANTRY_ALLOWED_IMAGES:
        allowed = ", ".join(settings.GANTRY_ALLOWED_IMAGES) or "none are configured (GANTRY_ALLOWED_IMAGES)"
        errors["image"] = [f"{image or 'an empty image'} is not allow-listed; allowed: {allowed}"]
    if runtime == Runtime.PROCESS and image:
        errors["image"] = ["the process runtime runs the host's own tritonserver; leave image empty"]
    for field, value in (("replicas", replicas), ("placement_policy", placement_policy)):
        try:
            Deployment._meta.get_field(field).clean(value, None)
        except DjangoValidationError as exc:
            errors[field] = list(exc.messages)
    for field, messages in autoscale_errors(autoscale, replicas).items():
        errors.setdefault(field if field == "replicas" else f"autoscale.{field}", []).extend(messages)
    pinned = list(GpuHost.objects.filter(name__in=hosts).prefetch_related("gpus"))
    unknown = sorted(set(hosts) - {h.name for h in pinned})
    if unknown:
        errors["hosts"] = [f"no GPU host named {n!r} has announced itself" for n in unknown]
        return None, pinned, [], errors
    pinned.sort(key=lambda h: hosts.index(h.name))
    reference = pinned[0] if pinned else _widest_online_host()
    if reference is None:
        errors["hosts"] = ["no GPU host is online to check the placements against"]
        return None, pinned, [], errors
    resolved, placement_errors = placements_check(host=reference, specs=placements, runtime=runtime, image=image)
    return reference, pinned, resolved, {**errors, **placement_errors}


def _widest_online_host() -> GpuHost | None:
    online = [h for h in GpuHost.objects.prefetch_related("gpus") if h.is_online]
    return min(online, key=lambda h: (-len(h.gpus.all()), h.name), default=None)


def deployment_preflight(
    *,
    name: str,
    hosts: list[str],
    placements: list[PlacementSpec],
    runtime: str = Runtime.PROCESS,
    image: str = "",
    server: ServerSpec = ServerSpec(),
    replicas: int = 1,
    placement_policy: str = PlacementPolicy.SPREAD,
    physical_gpus: bool = False,
    autoscale: AutoscaleSpec = AUTOSCALE_OFF,
    replaces: int | None = None,
    user: Any = None,
) -> dict[str, Any]:
    """What deployment_create (and a start) would say, without writing anything:
    every broken rule by field; where each replica would go (host and GPUs, or
    the closest host's shortfall); and the first replica's host's GPU plan with
    the placements beside what its other replicas hold (each model's share of
    each GPU, the headroom, what each share holds). ``replaces``: the deployment
    a change would give these placements, left out of the plan."""
    require_operator(user)
    reference, pinned, resolved, errors = _create_checks(
        name=name, hosts=hosts, placements=placements, runtime=runtime, image=image, server=server,
        replicas=replicas, placement_policy=placement_policy, autoscale=autoscale,
    )  # fmt: skip
    if reference is None:
        return {"valid": False, "errors": errors, "plan": [], "replicas": [], "warnings": []}
    rows = placement_rows(resolved)
    choices = replica_placement.plan_replicas(
        deployment=None, name=name or "this deployment", placements=rows, count=replicas, pinned=pinned,
        policy=placement_policy, lock=False, besides=replaces, physical=physical_gpus,
    )  # fmt: skip
    where = [
        {"replica": n, "host": c.host.name, "gpus": {str(k): v for k, v in c.gpu_map.items()}}
        if isinstance(c, Choice)
        else {"replica": n, "host": None, "problem": c}
        for n, c in enumerate(choices, start=1)
    ]
    # The first replica's host as placed, or (fitting nowhere) the reference host as numbered.
    first = next((c for c in choices if isinstance(c, Choice)), None) or Choice(host=reference, gpu_map={})
    holders = [
        Holder(key=None, name=name or "this deployment", placements=rows, gpu_map=first.gpu_map),
        *selectors.plan_holders(first.host, besides=replaces),
    ]
    gpus = {g for p in rows for g in replica_gpus(p, first.gpu_map, len(first.host.gpus.all()))}
    plan = [p.as_dict() for p in host_plan(first.host, holders) if p.index in gpus]
    if errors:  # what passed is drawn; what would happen at start is not foretold
        return {"valid": False, "errors": errors, "plan": plan, "replicas": where, "warnings": []}
    # Where nothing fits now, the start is refused, not the creation: said, not refused.
    warnings = [f"at start: replica {w['replica']}: {w['problem']}" for w in where if w["host"] is None]
    return {"valid": True, "errors": {}, "plan": plan, "replicas": where, "warnings": warnings}


def deployment_create(
    *,
    name: str,
    hosts: list[str],
    placements: list[PlacementSpec],
    runtime: str = Runtime.PROCESS,
    image: str = "",
    server: ServerSpec = ServerSpec(),
    replicas: int = 1,
    placement_policy: str = PlacementPolicy.SPREAD,
    physical_gpus: bool = False,
    autoscale: AutoscaleSpec = AUTOSCALE_OFF,
    user: Any = None,
) -> Deployment:
    """Create a stopped deployment of one or more models (nothing starts yet:
    its replicas are placed when it starts). ``hosts``: the hosts its replicas
    may run on (none: any online host)."""
    require_operator(user)
    _, pinned, resolved, errors = _create_checks(
        name=name, hosts=hosts, placements=placements, runtime=runtime, image=image, server=server,
        replicas=replicas, placement_policy=placement_policy, autoscale=autoscale,
    )  # fmt: skip
    if errors:
        raise ValidationFailed(errors)
    try:
        with transaction.atomic():
            deployment = Deployment.objects.create(
                name=name,
                runtime=runtime,
                image=image,
                replicas=replicas,
                placement_policy=placement_policy,
                physical_gpus=physical_gpus,
                **autoscale.columns(),
                **asdict(server),
                created_by=events.signed_in(user),
            )
            deployment.pinned_hosts.set(pinned)
            placements_write(deployment=deployment, resolved=resolved)
            DeploymentRevision.objects.create(
                deployment=deployment,
                generation=1,
                spec=placements_snapshot(deployment),
                created_by=deployment.created_by,
            )
            where = f"on {', '.join(h.name for h in pinned)}" if pinned else "on any online host with room"
            events.record(
                kind="deployment.created",
                source=events.source_of(user),
                actor=user,
                deployment=deployment,
                to_status=deployment.status,
                message=f"created with {', '.join(r.model.name for r in resolved)}: {replicas} "
                f"replica{'s' if replicas != 1 else ''} {where}; autoscaling {describe(autoscale)}",
            )
    except IntegrityError as exc:
        # Another request took the name between our check and insert.
        raise ValidationFailed({"name": f"{name!r} was taken concurrently; try again"}) from exc
    return deployment


def reference_host(deployment: Deployment) -> GpuHost:
    """The host a deployment's placements are checked against: a replica's, its
    first pinned host, or the widest online host."""
    replica = deployment.replica_set.select_related("host").order_by("serial").first()
    host = replica.host if replica else deployment.pinned_hosts.order_by("name").first() or _widest_online_host()
    if host is None:
        raise InvalidTransition(f"no GPU host is online to check {deployment.name}'s placements against")
    return GpuHost.objects.prefetch_related("gpus").get(pk=host.pk)


def deployment_change(
    *, deployment_id: int, placements: list[PlacementSpec], user: Any = None, reason: str = ""
) -> Deployment:
    """Give a deployment new placements as a new generation.

    A serving deployment rolls it out replica by replica (each reloads only the
    models that changed, and the roll goes back if one fails to load); one at
    rest takes it at its next start. Refused while it is starting or stopping.
    """
    require_operator(user)
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        running = deployment.status in (DeploymentStatus.READY, DeploymentStatus.DEGRADED)
        jobs.require_unheld(deployment, user)
        if not states.deployment_actions(deployment.status)["change"]:
            raise InvalidTransition(f"{deployment.name} is {deployment.status}; change it when it is ready or stopped")
        resolved = placements_validate(
            host=reference_host(deployment), specs=placements, runtime=deployment.runtime, image=deployment.image
        )
        if running:
            # Applied now, so it must fit beside whatever else holds each replica's GPUs.
            rows = placement_rows(resolved)
            problems = [
                f"{replica.label} on {replica.host.name}: {problem}"
                for replica in deployment.replica_set.select_related("host", "deployment").filter(
                    status__in=states.ACTIVE)
                for problem in replica_placement.fits_where_it_is(replica, rows)
            ]  # fmt: skip
            if problems:
                raise ValidationFailed({"models": problems})
        before = placements_snapshot(deployment)
        placements_write(deployment=deployment, resolved=resolved)
        after = placements_snapshot(deployment)
        if after == before:
            raise NothingToChange({"models": "this is what the deployment already holds: nothing to change"})
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
            replicas_service.roll_next(deployment_id=deployment.pk, source=events.source_of(user))
    return Deployment.objects.get(pk=deployment_id)


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


RESTARTABLE = frozenset({DeploymentStatus.READY, DeploymentStatus.DEGRADED, DeploymentStatus.FAILED})


def deployment_restart(*, deployment_id: int, user: Any = None) -> Deployment:
    """Stop the deployment's servers and start them again. A failed one with no
    server is simply started; one at rest is refused (start it)."""
    require_operator(user)
    deployment = _get_deployment(deployment_id)
    running = deployment.replica_set.filter(status__in=states.ACTIVE).exists()
    if deployment.status == DeploymentStatus.FAILED and not running:
        return deployment_start(deployment_id=deployment_id, user=user)
    if deployment.status not in RESTARTABLE:
        raise InvalidTransition(f"{deployment.name} is {deployment.status}; only a running deployment restarts")
    # Stopping with running desired: each replica starts again once stopped (replica_start_after_stop).
    return replicas_service.deployment_stop(
        deployment_id=deployment_id, source=events.source_of(user), actor=user,
        message="restart requested: stopping, then starting again", desired=DesiredState.RUNNING,
    )  # fmt: skip


def deployment_delete(*, deployment_id: int, user: Any = None) -> None:
    """Delete a deployment at rest: its name and ports are free again, its hosts
    remove its files, and its timeline stays (the events lose only the link).
    Refused while a server may run or while gateway aliases point at it."""
    require_operator(user)
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        if deployment.status not in states.AT_REST or deployment.replica_set.filter(status__in=states.ACTIVE).exists():
            raise InvalidTransition(f"{deployment.name} is {deployment.status}; stop it before deleting it")
        # The gateway's aliases (gateway.models.Alias) point here by a protected foreign key.
        aliases = sorted(deployment.aliases.values_list("name", flat=True))
        if aliases:
            raise InvalidTransition(
                f"gateway aliases point at {deployment.name}: {', '.join(aliases)}; move or delete them first"
            )
        hosts = sorted(set(deployment.replica_set.values_list("host__name", flat=True)))
        events.record(
            kind="deployment.deleted",
            source=events.source_of(user),
            actor=user,
            message=f"{deployment.name} deleted"
            + (f"; its replicas' ports on {', '.join(hosts)} are free" if hosts else ""),
            data={"deployment": deployment.pk, "name": deployment.name, "generation": deployment.generation},
        )
        for host_name in hosts:
            outbox.enqueue_on_commit(
                queues.FORGET_DEPLOYMENT, host_name=host_name, args=[deployment.pk, deployment.name]
            )
        deployment.delete()


def deployment_configure(*, deployment_id: int, server: ServerSpec, user: Any = None) -> Deployment:
    """Change the deployment's server settings (shared memory, log verbosity,
    drain timeout). A deployment at rest takes them at its next start; a running
    one is restarted, unless only the drain timeout changed (its next stop reads it)."""
    require_operator(user)
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        jobs.require_unheld(deployment, user)
        errors = _server_errors(server, deployment.runtime)
        if errors:
            raise ValidationFailed(errors)
        before = {name: getattr(deployment, name) for name in asdict(server)}
        if before == asdict(server):
            raise NothingToChange({"server": "these are the deployment's settings already: nothing to change"})
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
    running = deployment.replica_set.filter(status__in=states.ACTIVE).exists()
    if deployment.status in RESTARTABLE and running and server.restarts(before):
        return deployment_restart(deployment_id=deployment_id, user=user)
    return Deployment.objects.get(pk=deployment_id)


def deployment_start(*, deployment_id: int, user: Any = None) -> Deployment:
    """Start the deployment's replicas on hosts with room; refused unless it is
    at rest, or (nothing written) when a replica fits nowhere."""
    require_operator(user)
    return replicas_service.deployment_start(deployment_id=deployment_id, source=events.source_of(user), actor=user)


def deployment_stop(*, deployment_id: int, user: Any = None, now: bool = False) -> Deployment:
    """Stop every replica's server, each answering what it holds first (up to
    the deployment's drain timeout) unless ``now``; refused when nothing runs."""
    require_operator(user)
    deployment = _get_deployment(deployment_id)
    if not states.deployment_actions(deployment.status)["stop"]:
        raise InvalidTransition(f"{deployment.name} is {deployment.status}; there is nothing to stop")
    return replicas_service.deployment_stop(
        deployment_id=deployment_id, source=events.source_of(user), actor=user,
        message="stop requested" + (" (now: requests in flight are cut)" if now else ""),
        desired=DesiredState.STOPPED, drain=not now,
    )  # fmt: skip


def deployment_scale(*, deployment_id: int, replicas: int, user: Any = None) -> Deployment:
    """Set the deployment's replica count; a running one places or retires replicas now."""
    require_operator(user)
    return replicas_service.deployment_scale(
        deployment_id=deployment_id, replicas=replicas, source=events.source_of(user), actor=user
    )


def _get_deployment(deployment_id: int) -> Deployment:
    deployment = Deployment.objects.filter(pk=deployment_id).first()
    if deployment is None:
        raise NotFound(f"deployment {deployment_id} does not exist")
    return deployment


def record_deployment_event(*, deployment_id: int, kind: str, source: str, message: str) -> None:
    """Note something about a deployment on its timeline without changing its status."""
    with transaction.atomic():
        deployment = _get_deployment(deployment_id)
        events.record(kind=kind, source=source, deployment=deployment, message=message)
