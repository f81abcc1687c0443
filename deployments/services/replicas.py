"""Replicas: where each of a deployment's Triton servers runs, and what its host
is asked to do with it.

Placement reads every candidate host's one GPU plan (gpu_plan.choose_host):
the deployment's pinned hosts, or every online host. Spread puts replicas on
different hosts first, pack onto the fewest. A replica that fits nowhere is
refused before anything starts, with the closest host's shortfall.

``deployment_converge`` makes a running deployment's replicas match its
count: it places the missing ones and retires the surplus (the least useful
first: not ready, then the oldest generation, then the newest). Start and
scale call it; so does the control plane's sweep after a host is lost.

Every function here that writes locks the deployment's row first, then the
candidate hosts' rows, as deployments.services.deployments does.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Max, Q
from django.utils import timezone

from common.errors import InvalidTransition, NotFound, ValidationFailed
from deployments import events, outbox, queues, selectors, states
from deployments.gpu_plan import Candidate, Choice, Holder, choose_host, host_plan, plan_problems
from deployments.models import (
    Deployment,
    DeploymentModel,
    DeploymentStatus,
    DesiredState,
    GpuHost,
    PlacementPolicy,
    Replica,
)

S = DeploymentStatus


def allocate_ports(host: GpuHost) -> tuple[int, int, int]:
    """The lowest free triple of ports in the configured range on ``host``."""
    low, high = settings.GANTRY_TRITON_PORT_RANGE
    used: set[int] = set()
    for row in Replica.objects.filter(host=host).values_list("http_port", "grpc_port", "metrics_port"):
        used.update(row)
    for base in range(low, high - 1, 3):
        triple = (base, base + 1, base + 2)
        if not used.intersection(triple):
            return triple
    raise InvalidTransition(f"no free ports left in GANTRY_TRITON_PORT_RANGE on {host.name}")


def candidate_hosts(pinned: list[GpuHost], *, lock: bool, replacing: bool = False) -> list[GpuHost]:
    """The hosts a deployment's replicas may go to: its pinned hosts that are
    online, else every online host; their rows locked with ``lock`` (in id
    order), so two placements are checked one after the other. A person's
    start on pinned hosts that are all offline still places there (the launch
    waits for the host); a replacement for a lost replica never does."""
    rows = GpuHost.objects.filter(pk__in=[h.pk for h in pinned]) if pinned else GpuHost.objects.all()
    if lock:
        list(rows.select_for_update().order_by("pk").values_list("pk", flat=True))
    found = list(rows.prefetch_related("gpus").order_by("name"))
    online = [host for host in found if host.is_online]
    return online or (found if pinned and not replacing else [])


def plan_replicas(
    *,
    deployment: Deployment | None,
    name: str,
    placements: list[DeploymentModel],
    count: int,
    pinned: list[GpuHost],
    policy: str,
    lock: bool,
    besides: int | None = None,
    replacing: bool = False,
) -> list[Choice | str]:
    """Where ``count`` more replicas of the placements would go, one after the
    other, each seeing the ones before: a Choice, or why it fits nowhere.
    ``besides``: a deployment whose replicas the plans leave out; ``replacing``:
    these replace lost replicas (candidate_hosts)."""
    hosts = candidate_hosts(pinned, lock=lock, replacing=replacing)
    holders = selectors.plan_holders_by_host(hosts, besides=besides)
    siblings: Counter[int] = Counter()
    if deployment is not None:
        siblings.update(
            deployment.replica_set.filter(desired_state=DesiredState.RUNNING)
            .exclude(status__in=[S.LOST, S.STOPPED])
            .values_list("host_id", flat=True)
        )
    key = deployment.pk if deployment is not None else None
    choices: list[Choice | str] = []
    for n in range(count):
        replica = Holder(key=key, name=name, placements=placements, status="planned", replica=-(n + 1))
        candidates = [Candidate(host=h, holders=holders.get(h.pk, []), siblings=siblings[h.pk]) for h in hosts]
        choice = choose_host(
            candidates, replica, pack=policy == PlacementPolicy.PACK, identity=bool(pinned) and not siblings
        )
        choices.append(choice)
        if isinstance(choice, Choice):
            holders.setdefault(choice.host.pk, []).append(
                Holder(key=key, name=name, placements=placements, status="planned", replica=-(n + 1),
                       gpu_map=choice.gpu_map)
            )  # fmt: skip
            siblings[choice.host.pk] += 1
    return choices


def _next_serial(deployment: Deployment) -> int:
    return (deployment.replica_set.aggregate(top=Max("serial"))["top"] or 0) + 1


def _place(deployment: Deployment, count: int, *, replacing: bool) -> list[Replica]:
    """Create ``count`` replicas of a locked deployment on the hosts chosen for
    them (pending); InvalidTransition with the shortfall when one fits nowhere."""
    placements = list(deployment.placements.select_related("registered_model", "engine_build"))
    pinned = list(deployment.pinned_hosts.all())
    choices = plan_replicas(
        deployment=deployment, name=deployment.name, placements=placements, count=count, pinned=pinned,
        policy=deployment.placement_policy, lock=True, replacing=replacing,
    )  # fmt: skip
    created = []
    for choice in choices:
        if isinstance(choice, str):
            where = ", ".join(h.name for h in pinned) if pinned else "any online host"
            raise InvalidTransition(
                f"{deployment.name}'s replica {len(created) + 1} of {count} fits on no host ({where}): {choice}"
            )
        http, grpc, metrics = allocate_ports(choice.host)
        created.append(
            Replica.objects.create(
                deployment=deployment,
                serial=_next_serial(deployment),
                host=choice.host,
                gpu_map={str(k): v for k, v in choice.gpu_map.items()},
                http_port=http,
                grpc_port=grpc,
                metrics_port=metrics,
                generation=deployment.generation,
            )
        )
    return created


def _launch(replica: Replica, *, source: str, actor: Any = None, message: str) -> Replica:
    replica = states.replica_transition(
        replica_id=replica.pk, to=S.LAUNCHING, source=source, actor=actor, message=message,
        generation=replica.deployment.generation,
    )  # fmt: skip
    enqueue(queues.LAUNCH_DEPLOYMENT, replica)
    return replica


def enqueue(task_name: str, replica: Replica, *more_args: Any) -> None:
    outbox.enqueue_on_commit(task_name, host_name=replica.host.name, args=[replica.pk, *more_args])


def fits_where_it_is(replica: Replica, placements: list[DeploymentModel]) -> list[str]:
    """What is wrong with the replica's host's plan with it there (its host's row locked)."""
    host = GpuHost.objects.select_for_update().prefetch_related("gpus").get(pk=replica.host_id)
    holders = [
        Holder(key=replica.deployment_id, name=replica.deployment.name, placements=placements,
               status=replica.status, replica=replica.serial, gpu_map=replica.gpus),
        *selectors.plan_holders(host, besides_replica=replica.pk),
    ]  # fmt: skip
    gpus = {plan.index for plan in host_plan(host, holders[:1])}
    return plan_problems(host_plan(host, holders), own=replica.deployment_id, gpus=gpus)


def deployment_converge(*, deployment_id: int, source: str, actor: Any = None) -> Deployment:
    """Make a deployment wanted running hold its count of replicas: restart the
    ones at rest where they still fit (or place them anew), place the missing,
    and retire the surplus. InvalidTransition (nothing written) when a missing
    one fits nowhere."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        if deployment.desired_state != DesiredState.RUNNING:
            return deployment
        placements = list(deployment.placements.select_related("registered_model", "engine_build"))
        replicas = list(deployment.replica_set.select_related("host", "deployment").filter(
            desired_state=DesiredState.RUNNING))  # fmt: skip
        alive = [r for r in replicas if r.status not in states.AT_REST and r.status != S.LOST]
        for replica in [r for r in replicas if r.status in states.AT_REST]:
            if len(alive) >= deployment.replicas or not replica.host.is_online or fits_where_it_is(replica, placements):
                _retire(replica, source=source, why="not needed where it was")
                continue
            alive.append(_launch(replica, source=source, actor=actor, message="start requested"))
        missing = deployment.replicas - len(alive)
        if missing > 0:
            replacing = any(r.status == S.LOST for r in replicas)
            for replica in _place(deployment, missing, replacing=replacing):
                replica.deployment = deployment
                words = f"placed on {replica.host.name} GPU(s) {_gpus_words(replica)}"
                alive.append(_launch(replica, source=source, actor=actor, message=words))
        elif missing < 0:
            for replica in _surplus(alive, -missing, deployment.generation):
                _retire(replica, source=source, why=f"surplus: {deployment.name} wants {deployment.replicas}")
        return states.deployment_sync(deployment_id=deployment_id, source=source, actor=actor)


def _gpus_words(replica: Replica) -> str:
    return ", ".join(str(index) for _, index in sorted(replica.gpus.items())) or "none (CPU)"


def _surplus(replicas: list[Replica], count: int, generation: int) -> list[Replica]:
    """Which ``count`` of ``replicas`` to retire: those not ready first, then the
    oldest generation, then the newest replica."""
    ranked = sorted(replicas, key=lambda r: (r.status == S.READY, r.generation == generation, -r.serial))
    return ranked[:count]


def _retire(replica: Replica, *, source: str, why: str) -> None:
    """A replica no longer wanted: stopped (then removed) if a server may run,
    removed now if none does."""
    Replica.objects.filter(pk=replica.pk).update(desired_state=DesiredState.STOPPED)
    if replica.status in states.ACTIVE - {S.STOPPING}:
        states.replica_transition(replica_id=replica.pk, to=S.STOPPING, source=source, message=f"retiring: {why}")
        enqueue(queues.STOP_DEPLOYMENT, replica)
    elif replica.status not in (S.STOPPING,):
        replica_remove(replica=replica, source=source, why=why)


def replica_remove(*, replica: Replica, source: str, why: str) -> None:
    """Delete a replica with no server: its ports are free again, and its host
    removes its files."""
    events.record(
        kind="replica.removed",
        source=source,
        deployment=replica.deployment,
        host=replica.host,
        message=f"{replica.label} on {replica.host.name} removed ({why}); ports {replica.http_port}/"
        f"{replica.grpc_port}/{replica.metrics_port} are free",
        data={"replica": replica.serial, "replica_id": replica.pk},
    )
    outbox.enqueue_on_commit(
        queues.FORGET_DEPLOYMENT,
        host_name=replica.host.name,
        args=[replica.deployment_id, replica.deployment.name, replica.serial],
    )
    replica.delete()


def deployment_scale(*, deployment_id: int, replicas: int, source: str, actor: Any = None) -> Deployment:
    """Set how many replicas serve the deployment; a running one converges now."""
    field = Deployment._meta.get_field("replicas")
    try:
        field.run_validators(replicas)
    except Exception as exc:  # noqa: BLE001 - Django's ValidationError, said by field
        raise ValidationFailed({"replicas": list(getattr(exc, "messages", [str(exc)]))}) from exc
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        if not states.deployment_actions(deployment.status)["scale"]:
            raise InvalidTransition(f"{deployment.name} is {deployment.status}; scale it when that is done")
        if deployment.replicas == replicas:
            raise ValidationFailed({"replicas": f"{deployment.name} already has {replicas}: nothing to change"})
        before = deployment.replicas
        Deployment.objects.filter(pk=deployment_id).update(replicas=replicas)
        events.record(
            kind="deployment.scaled",
            source=source,
            actor=actor,
            deployment=deployment,
            message=f"replicas {before} → {replicas}",
            data={"before": before, "after": replicas},
        )
        return deployment_converge(deployment_id=deployment_id, source=source, actor=actor)


def deployment_start(*, deployment_id: int, source: str, actor: Any = None) -> Deployment:
    """Want the deployment running and start its replicas; InvalidTransition
    (nothing written) when one fits nowhere or it is not at rest."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        if not states.deployment_actions(deployment.status)["start"]:
            raise InvalidTransition(
                f"{deployment.name} is {deployment.status}; only a stopped, failed or new deployment can start"
            )
        Deployment.objects.filter(pk=deployment_id).update(desired_state=DesiredState.RUNNING)
        # Replicas retired or stopped earlier are wanted again where they still fit.
        deployment.replica_set.filter(status__in=states.AT_REST).update(desired_state=DesiredState.RUNNING)
        return deployment_converge(deployment_id=deployment_id, source=source, actor=actor)


def deployment_stop(*, deployment_id: int, source: str, actor: Any = None, message: str, desired: str) -> Deployment:
    """Stop every replica that may run a server; with ``desired`` running (a
    restart) each starts again once stopped."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        Deployment.objects.filter(pk=deployment_id).update(desired_state=desired)
        replicas = list(deployment.replica_set.select_related("host", "deployment"))
        stopped = 0
        for replica in replicas:
            if replica.status in states.ACTIVE - {S.STOPPING}:
                states.replica_transition(
                    replica_id=replica.pk, to=S.STOPPING, source=source, actor=actor, message=message
                )
                enqueue(queues.STOP_DEPLOYMENT, replica)
                stopped += 1
            elif replica.status == S.LOST:
                states.replica_transition(
                    replica_id=replica.pk, to=S.STOPPED, source=source, actor=actor,
                    message=f"{message}; its host is offline: a server found there when it is back is stopped",
                )  # fmt: skip
        if not stopped and not any(r.status == S.STOPPING for r in replicas):
            raise InvalidTransition(f"{deployment.name} is {deployment.status}; there is nothing to stop")
        return states.deployment_sync(deployment_id=deployment_id, source=source, actor=actor)


def replica_start_after_stop(*, replica_id: int, source: str) -> None:
    """A replica that stopped: start it again (a restart) if its deployment is
    wanted running and it is too; remove it if it was retired."""
    with transaction.atomic():
        replica = Replica.objects.select_related("deployment", "host").filter(pk=replica_id).first()
        if replica is None:
            return
        deployment = Deployment.objects.select_for_update().get(pk=replica.deployment_id)
        replica = Replica.objects.select_related("deployment", "host").get(pk=replica_id)
        if replica.status != S.STOPPED:
            return
        if replica.desired_state != DesiredState.RUNNING:
            replica_remove(replica=replica, source=source, why="retired")
            states.deployment_sync(deployment_id=deployment.pk, source=source)
            return
        if deployment.desired_state == DesiredState.RUNNING:
            _launch(replica, source=source, message="restarting: starting again")


def replica_relaunch(*, replica_id: int, source: str, attempt: int) -> Replica:
    """Restart a failed replica that should be running (a crashed server)."""
    with transaction.atomic():
        replica = states.replica_transition(
            replica_id=replica_id,
            to=S.LAUNCHING,
            source=source,
            only_from=frozenset({S.FAILED}),
            message=f"restarting after a crash (attempt {attempt})",
        )
        events.record(
            kind="deployment.crash_restart",
            source=source,
            deployment=replica.deployment,
            host=replica.host,
            message=f"{replica.label}: automatic restart {attempt} of {settings.GANTRY_CRASH_RESTART_LIMIT}",
            data={"replica": replica.serial, "replica_id": replica.pk},
        )
        enqueue(queues.LAUNCH_DEPLOYMENT, replica)
    return replica


# What a replica in a passing state waits for, sent again when it may be lost.
REDRIVEN_TASKS = {
    S.LAUNCHING: queues.LAUNCH_DEPLOYMENT,
    S.STOPPING: queues.STOP_DEPLOYMENT,
    S.UPDATING: queues.APPLY_GENERATION,
}


def replica_redrive(*, replica_id: int, source: str, message: str) -> bool:
    """Send a launching, stopping or updating replica's task again (the first
    was lost with its worker or its broker); False when one still waits in the
    outbox.

    A duplicate is harmless: each of these tasks holds a lock per replica on
    its host, acts only on a row in the state (and generation) it expects, and
    only one of two racing tasks can move it on.
    """
    with transaction.atomic():
        replica = Replica.objects.select_related("host", "deployment").select_for_update().get(pk=replica_id)
        task = REDRIVEN_TASKS.get(replica.status)
        if task is None:
            raise InvalidTransition(f"{replica.label} is {replica.status}, not launching, stopping or updating")
        updating = replica.status == S.UPDATING
        return outbox.redrive(
            task,
            host_name=replica.host.name,
            args=[replica.pk, replica.deployment.generation] if updating else [replica.pk],
            source=source,
            message=f"{replica.label}: {message}",
            deployment=replica.deployment,
        )


def replica_fail(
    *,
    replica_id: int,
    reason: str,
    source: str,
    only_from: frozenset[str],
    log_tail: str = "",
    server_exit: dict[str, Any] | None = None,
) -> bool:
    """Mark a replica failed with ``reason`` (and the server's last log lines,
    and how it exited) if it is still in one of ``only_from``; False when it had
    moved on."""
    data = {key: value for key, value in (("log_tail", log_tail), ("exit", server_exit)) if value}
    try:
        states.replica_transition(
            replica_id=replica_id, to=S.FAILED, source=source, only_from=only_from, runtime_handle="",
            message=reason, data=data or None,
        )  # fmt: skip
    except InvalidTransition:
        return False
    return True


def replica_server_replaced(*, replica_id: int, runtime_handle: str) -> bool:
    """Record the new server a replica being updated now runs on (a container
    restarted for its new generation); False when it is no longer updating."""
    return bool(Replica.objects.filter(pk=replica_id, status=S.UPDATING).update(runtime_handle=runtime_handle))


def record_replica_event(*, replica_id: int, kind: str, source: str, message: str) -> None:
    """Note something about a replica on its deployment's and host's timelines."""
    with transaction.atomic():
        replica = Replica.objects.select_related("deployment", "host").filter(pk=replica_id).first()
        if replica is None:
            return
        events.record(
            kind=kind, source=source, deployment=replica.deployment, host=replica.host,
            message=f"{replica.label} on {replica.host.name}: {message}",
            data={"replica": replica.serial, "replica_id": replica.pk},
        )  # fmt: skip


def roll_next(*, deployment_id: int, source: str) -> Replica | None:
    """Move the next ready replica that serves another generation than its
    deployment's to it (one at a time: the alias keeps the others); None when
    every replica serves it, or one is being updated now."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=deployment_id)
        replicas = deployment.replica_set.select_related("host", "deployment").filter(
            desired_state=DesiredState.RUNNING
        )
        if replicas.filter(status=S.UPDATING).exists():
            return None
        behind = replicas.filter(status=S.READY).exclude(generation=deployment.generation).order_by("serial").first()
        if behind is None:
            return None
        replica = states.replica_transition(
            replica_id=behind.pk, to=S.UPDATING, source=source, only_from=frozenset({S.READY}),
            message=f"generation {behind.generation} → {deployment.generation}",
        )  # fmt: skip
        enqueue(queues.APPLY_GENERATION, replica, deployment.generation)
        return replica


def replica_ready(*, replica_id: int, source: str, message: str, from_status: str, generation: int) -> Replica:
    """A replica whose server has every model ready at ``generation``."""
    replica = states.replica_transition(
        replica_id=replica_id, to=S.READY, source=source, only_from=frozenset({from_status}), message=message,
        generation=generation,
    )  # fmt: skip
    roll_next(deployment_id=replica.deployment_id, source=source)
    return replica


def replace_lost(*, source: str) -> list[Replica]:
    """Mark lost the replicas of hosts that have not beaten for
    GANTRY_HOST_LOST_GRACE_S (not on a first missed beat: a host that flaps
    within the grace causes no churn), then converge every deployment short of
    replicas: replacements start on hosts with room. A deployment that fits
    nowhere now says so on its timeline (once per lost replica) and is tried
    again at the next sweep. Returns the replicas found lost now."""
    lost = _mark_lost(source=source, grace_s=settings.GANTRY_HOST_LOST_GRACE_S)
    short = Deployment.objects.filter(desired_state=DesiredState.RUNNING, replica_set__status=S.LOST).distinct()
    for deployment_id in short.values_list("pk", flat=True):
        try:
            deployment_converge(deployment_id=deployment_id, source=source)
        except InvalidTransition as exc:
            for replica in [r for r in lost if r.deployment_id == deployment_id]:
                record_replica_event(
                    replica_id=replica.pk, kind="replica.unplaced", source=source, message=f"no replacement yet: {exc}"
                )
    return lost


def _mark_lost(*, source: str, grace_s: float) -> list[Replica]:
    cutoff = timezone.now() - timedelta(seconds=grace_s)
    lost = []
    stale = Replica.objects.filter(status__in=states.ACTIVE).filter(
        Q(host__last_heartbeat__lt=cutoff) | Q(host__last_heartbeat__isnull=True)
    )
    for replica_id, name in stale.values_list("pk", "host__name"):
        try:
            lost.append(
                states.replica_transition(
                    replica_id=replica_id,
                    to=S.LOST,
                    source=source,
                    message=f"{name} has not beaten for {grace_s:.0f}s; replacing it on hosts with room",
                )  # fmt: skip
            )
        except InvalidTransition:
            continue
    return lost
