"""Replicas: what each host is asked to do with a deployment's Triton servers.

``deployment_converge`` makes a running deployment's replicas match its
count: it places the missing ones (services.replica_placement) and retires
the surplus (the least useful first: not ready, then the oldest generation,
then the newest). Start and scale call it; so does the control plane's sweep
after a host is lost.

A new generation rolls one replica at a time (``roll_next``). A replica whose
change needs a new server surges when a host has room (``replica_surge``: a
new replica of the new generation starts beside it, and the old one is
retired once that one is ready); otherwise it is taken out and restarted in
place, so at most one replica is unavailable. A replica of the new generation
that fails to load stops the roll and rolls every replica back.

Every function here that writes locks the deployment's row first, then the
candidate hosts' rows, as deployments.services.deployments does.

Over 450 lines on purpose: converge, retire, relaunch, roll, surge, a host's
drain and a lost host's replacement call one another (a ready replica takes the roll on, a
failed one rolls it back); split, the pieces would import each other round a
circle, which tests/unit/test_layers.py refuses.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Exists, F, OuterRef, Q
from django.utils import timezone

from common.errors import InvalidTransition, NotFound, NothingToChange, ValidationFailed
from core import events, queues
from deployments import states
from deployments.gpu_plan import Choice
from deployments.models import Deployment, DeploymentStatus, DesiredState, Replica
from deployments.services import replica_placement as placing
from deployments.services.generations import deployment_rollback
from hosts import outbox
from hosts.models import Cordon
from hosts.services import hosts

S = DeploymentStatus


def _launch(replica: Replica, *, source: str, actor: Any = None, message: str) -> Replica:
    replica = states.replica_transition(
        replica_id=replica.pk, to=S.LAUNCHING, source=source, actor=actor, message=message,
        generation=replica.deployment.generation,
    )  # fmt: skip
    enqueue(queues.LAUNCH_REPLICA, replica)
    return replica


# The tasks that run a replica by its plan: it is resolved as they are sent.
_PLANNED_TASKS = frozenset({queues.LAUNCH_REPLICA, queues.APPLY_GENERATION})


def enqueue(task_name: str, replica: Replica, *more_args: Any) -> None:
    if task_name in _PLANNED_TASKS:
        placing.replicas_plan_write(replica.deployment_id, replica_id=replica.pk)
    outbox.enqueue_on_commit(task_name, host_name=replica.host.name, args=[replica.pk, *more_args])


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
            if (
                len(alive) >= deployment.replicas
                or not replica.host.is_online
                or replica.host.is_cordoned
                or placing.fits_where_it_is(replica, placements)
            ):
                _retire(replica, source=source, why="not needed where it was")
                continue
            alive.append(_launch(replica, source=source, actor=actor, message="start requested"))
        missing = deployment.replicas - len(alive)
        if missing > 0:
            replacing = any(r.status == S.LOST for r in replicas)
            for replica in placing.replicas_place(deployment, missing, replacing=replacing):
                words = f"placed on {replica.host.name} GPU(s) {placing.gpus_words(replica)}"
                alive.append(_launch(replica, source=source, actor=actor, message=words))
        elif missing < 0:
            for replica in _surplus(alive, -missing, deployment.generation):
                _retire(replica, source=source, why=f"surplus: {deployment.name} wants {deployment.replicas}")
        return states.deployment_sync(deployment_id=deployment_id, source=source, actor=actor)


def _surplus(replicas: list[Replica], count: int, generation: int) -> list[Replica]:
    """Which ``count`` of ``replicas`` to retire: those on cordoned hosts first
    (a host drain's replacements are ready), then those not ready, then those
    not at the deployment's ``generation`` (the oldest first), then the newest."""
    cordoned = set(Cordon.objects.filter(host_id__in={r.host_id for r in replicas}).values_list("host_id", flat=True))

    def rank(r: Replica) -> tuple:
        return (r.host_id not in cordoned, r.status == S.READY, r.generation == generation, r.generation, -r.serial)

    return sorted(replicas, key=rank)[:count]


def _retire(replica: Replica, *, source: str, why: str) -> None:
    """A replica no longer wanted: stopped (then removed) if a server may run,
    removed now if none does."""
    Replica.objects.filter(pk=replica.pk).update(desired_state=DesiredState.STOPPED)
    if replica.status in states.ACTIVE - {S.STOPPING}:
        _stop(replica, source=source, message=f"retiring: {why}", drain=True)
    elif replica.status not in (S.STOPPING,):
        replica_remove(replica=replica, source=source, why=why)


def _stop(replica: Replica, *, source: str, message: str, drain: bool, actor: Any = None) -> None:
    """Move a replica that may run a server to stopping and send its host the
    stop. With ``drain``, one that answers requests leaves balancing (stopping
    is not answering: every door stops sending to it within its route cache's
    second) and its host lets it finish what it holds, for up to the
    deployment's drain timeout, before its server is stopped."""
    seconds = replica.deployment.drain_timeout_s if drain and replica.status in states.ANSWERING else 0
    until = timezone.now() + timedelta(seconds=seconds) if seconds else None
    if until is not None:
        message += f"; draining the requests it holds for up to {seconds}s"
    states.replica_transition(
        replica_id=replica.pk, to=S.STOPPING, source=source, actor=actor, message=message, drain_until=until
    )
    enqueue(queues.STOP_REPLICA, replica)


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


def deployment_scale(
    *, deployment_id: int, replicas: int, source: str, actor: Any = None, why: str = "", kind: str = "deployment.scaled"
) -> Deployment:
    """Set how many replicas serve the deployment (within autoscaling's bounds
    while it is on); a running one converges now. ``why`` goes on the timeline."""
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
            raise NothingToChange({"replicas": f"{deployment.name} already has {replicas}: nothing to change"})
        low, high = deployment.min_replicas or 1, deployment.max_replicas
        if high is not None and not low <= replicas <= high:
            raise ValidationFailed(
                {"replicas": f"{replicas} is outside autoscaling's bounds {low}..{high}: change those, or turn it off"}
            )
        before = deployment.replicas
        Deployment.objects.filter(pk=deployment_id).update(
            replicas=replicas, scaled_at=timezone.now(), autoscale_low_since=None
        )
        events.record(
            kind=kind,
            source=source,
            actor=actor,
            deployment=deployment,
            message=f"replicas {before} → {replicas}" + (f": {why}" if why else ""),
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


def deployment_stop(
    *, deployment_id: int, source: str, actor: Any = None, message: str, desired: str, drain: bool = True
) -> Deployment:
    """Stop every replica that may run a server, each drained first unless not
    ``drain`` (a stop "now"); with ``desired`` running (a restart) each starts
    again once stopped."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        Deployment.objects.filter(pk=deployment_id).update(desired_state=desired)
        replicas = list(deployment.replica_set.select_related("host", "deployment"))
        stopped = 0
        for replica in replicas:
            if replica.status in states.ACTIVE - {S.STOPPING}:
                _stop(replica, source=source, actor=actor, message=message, drain=drain)
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
            # The roll's next step first: a joined host whose last replica of the deployment
            # this was may not lock the deployment once the row is gone (hosts.grants).
            roll_next(deployment_id=deployment.pk, source=source)
            replica_remove(replica=replica, source=source, why="retired")
            states.deployment_sync(deployment_id=deployment.pk, source=source)
            return
        if deployment.desired_state == DesiredState.RUNNING:
            _launch(replica, source=source, message="restarting: starting again")


def replica_fetched(*, replica: Replica, source: str, message: str) -> Replica:
    """A replica that waited for its host to fetch a hub model launches now."""
    replica = states.replica_transition(
        replica_id=replica.pk, to=S.LAUNCHING, source=source, only_from=frozenset({S.FETCHING}), message=message
    )
    enqueue(queues.LAUNCH_REPLICA, replica)
    return replica


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
        enqueue(queues.LAUNCH_REPLICA, replica)
    return replica


# What a replica in a passing state waits for, sent again when it may be lost.
REDRIVEN_TASKS = {
    S.LAUNCHING: queues.LAUNCH_REPLICA,
    S.STOPPING: queues.STOP_REPLICA,
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


def _replica_about(replica_id: int) -> dict[str, Any]:
    """A replica's task is told on its deployment's timeline."""
    replica = Replica.objects.select_related("deployment").filter(pk=replica_id).first()
    return {"deployment": replica.deployment} if replica is not None else {}


def _replicas_resend(host_name: str, source: str, message: str) -> list[str]:
    sent = []
    passing = Replica.objects.filter(host__name=host_name, status__in=list(REDRIVEN_TASKS))
    for replica_id, name, serial in passing.values_list("pk", "deployment__name", "serial"):
        try:
            if replica_redrive(replica_id=replica_id, source=source, message=message):
                sent.append(f"deployment {name} r{serial}")
        except InvalidTransition:
            pass  # it moved on meanwhile
    return sent


# A replica's status says which of the three it waits for: its launch's registration resends them all.
for _task in REDRIVEN_TASKS.values():
    outbox.register(
        outbox.HostTask(
            _task,
            about=_replica_about,
            resend_waiting=_replicas_resend if _task == queues.LAUNCH_REPLICA else None,
        )
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
    before = Replica.objects.filter(pk=replica_id).values_list("status", flat=True).first()
    try:
        states.replica_transition(
            replica_id=replica_id, to=S.FAILED, source=source, only_from=only_from, runtime_handle="",
            message=reason, data=data or None,
        )  # fmt: skip
    except InvalidTransition:
        return False
    if before in (S.LAUNCHING, S.FETCHING, S.LOADING):
        _roll_failed(replica_id, reason, source)
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


def replica_drain_told(*, replica_id: int, in_flight: int, source: str, message: str, ended: bool = False) -> None:
    """What a draining replica's host saw: the requests its server still holds
    (on its row, for the page) and, ``ended``, how the drain ended."""
    fields: dict[str, Any] = {"in_flight": in_flight}
    if ended:
        fields["drain_until"] = None
    Replica.objects.filter(pk=replica_id, status=S.STOPPING).update(**fields)
    record_replica_event(replica_id=replica_id, kind="replica.draining", source=source, message=message)


# A roll waits while one of these is under way: one replica at a time.
ROLL_BUSY = frozenset({S.LAUNCHING, S.FETCHING, S.LOADING, S.UPDATING})


def roll_next(*, deployment_id: int, source: str) -> Replica | None:
    """Take the deployment's roll one step: retire a replica the roll made
    surplus (an older generation's, once its surge replacement is ready), or
    move the next ready replica that serves another generation than the
    deployment's to it. One at a time: None while a replica is starting,
    updating or being retired, or when every replica serves the generation."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        # None: a joined host that serves none of it may not lock it (hosts.grants); the hosts
        # that do take the next step at their next move.
        if deployment is None or deployment.desired_state != DesiredState.RUNNING:
            return None
        rows = list(deployment.replica_set.select_related("host", "deployment"))
        if any(r.status in ROLL_BUSY or r.status == S.STOPPING for r in rows):
            return None
        alive = [r for r in rows if r.desired_state == DesiredState.RUNNING and r.status in states.ANSWERING]
        if len(alive) > deployment.replicas:
            for replica in _surplus(alive, len(alive) - deployment.replicas, deployment.generation):
                why = f"rolled: generation {deployment.generation} serves in its place"
                if replica.host.is_cordoned:
                    why = f"its host {replica.host.name} is cordoned: its replacement is ready"
                _retire(replica, source=source, why=why)
            return None
        behind = sorted(
            (r for r in alive if r.status == S.READY and r.generation != deployment.generation), key=lambda r: r.serial
        )
        if not behind:
            return None
        replica = states.replica_transition(
            replica_id=behind[0].pk, to=S.UPDATING, source=source, only_from=frozenset({S.READY}),
            message=f"generation {behind[0].generation} → {deployment.generation}",
        )  # fmt: skip
        enqueue(queues.APPLY_GENERATION, replica, deployment.generation)
        return replica


def replica_surge(*, replica_id: int, generation: int, why: str, source: str) -> Replica | None:
    """An updating replica whose ``generation`` needs a new server: when a
    host has room for one more replica, start a new one of that generation
    there and put this one back to serving its own until the new one is ready
    (max surge 1); the new replica, or None when there is no room (the caller
    restarts this one in place: max unavailable 1) or the replica moved on."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=Replica.objects.get(pk=replica_id).deployment_id)
        replica = Replica.objects.select_related("host", "deployment").get(pk=replica_id)
        if replica.status != S.UPDATING or deployment.generation != generation:
            return None
        if deployment.replica_set.filter(desired_state=DesiredState.RUNNING).count() > deployment.replicas:
            return None  # one surge at a time
        choice = placing.replicas_plan_for(deployment, 1, replacing=True)[0]
        if not isinstance(choice, Choice):
            record_replica_event(
                replica_id=replica_id, kind="replica.roll", source=source,
                message=f"no room for a surge replica ({choice}): restarting it in place",
            )  # fmt: skip
            return None
        surge = placing.replica_create(deployment, choice)
        states.replica_transition(
            replica_id=replica_id, to=S.READY, source=source, only_from=frozenset({S.UPDATING}),
            message=f"keeps serving generation {replica.generation} until {surge.label} of generation {generation} "
            f"is ready ({why})",
        )  # fmt: skip
        return _launch(
            surge, source=source,
            message=f"surge for generation {generation}, placed on {surge.host.name} GPU(s) "
            f"{placing.gpus_words(surge)}; {replica.label} is retired once this one is ready",
        )  # fmt: skip


def _roll_failed(replica_id: int, reason: str, source: str) -> None:
    """A replica of its deployment's newest generation failed to start while
    replicas of an older one still serve (a surge, or a placement during a
    roll): the generation is rolled back, the replica removed, and the roll
    takes the replicas that already moved back."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=Replica.objects.get(pk=replica_id).deployment_id)
        replica = Replica.objects.select_related("host", "deployment").get(pk=replica_id)
        older = deployment.replica_set.filter(
            desired_state=DesiredState.RUNNING, status__in=states.ANSWERING, generation__lt=replica.generation
        )
        if replica.status != S.FAILED or replica.generation != deployment.generation or not older.exists():
            return
        try:
            deployment_rollback(
                deployment_id=deployment.pk, failed_generation=replica.generation, reason=reason, source=source
            )
        except InvalidTransition:
            return
        Replica.objects.filter(pk=replica_id).update(desired_state=DesiredState.STOPPED)
        replica_remove(replica=replica, source=source, why=f"generation {replica.generation} failed to start on it")
        states.deployment_sync(deployment_id=deployment.pk, source=source)
        roll_next(deployment_id=deployment.pk, source=source)


def replica_ready(*, replica_id: int, source: str, message: str, from_status: str, generation: int) -> Replica:
    """A replica whose server has every model ready at ``generation``."""
    replica = states.replica_transition(
        replica_id=replica_id, to=S.READY, source=source, only_from=frozenset({from_status}), message=message,
        generation=generation,
    )  # fmt: skip
    roll_next(deployment_id=replica.deployment_id, source=source)
    return replica


def host_drain(*, host_name: str, user: Any = None) -> list[str]:
    """Cordon a host and move its replicas off it, as kubectl drain does: each
    serving replica gets a replacement placed on another host, and is retired
    (drained) only once that one is ready (roll_next retires the replicas on
    cordoned hosts first); one not serving is retired and placed anew at once.
    A replica with no room elsewhere keeps serving there, said on the timeline.
    What happened to each replica, in words."""
    host = hosts.host_cordon(host_name=host_name, user=user, reason="drained")
    source = events.source_of(user)
    said: list[str] = []
    deployment_ids = (
        Replica.objects.filter(
            host=host, desired_state=DesiredState.RUNNING, deployment__desired_state=DesiredState.RUNNING
        )
        .exclude(status=S.LOST)
        .values_list("deployment_id", flat=True)
        .distinct()
    )
    for deployment_id in sorted(set(deployment_ids)):
        with transaction.atomic():
            deployment = Deployment.objects.select_for_update().get(pk=deployment_id)
            leaving = (
                deployment.replica_set.select_related("host", "deployment")
                .filter(host=host, desired_state=DesiredState.RUNNING)
                .exclude(status=S.LOST)
            )
            resting = False
            for replica in leaving:
                where = f"{deployment.name} {replica.label}"
                if replica.status not in states.ANSWERING:
                    _retire(replica, source=source, why=f"its host {host.name} is drained")
                    said.append(f"{where}: retired ({replica.status}), placed anew elsewhere")
                    resting = True
                    continue
                choice = placing.replicas_plan_for(deployment, 1, replacing=True)[0]
                if not isinstance(choice, Choice):
                    record_replica_event(
                        replica_id=replica.pk, kind="replica.unplaced", source=source,
                        message=f"stays on {host.name}, which is cordoned: no room elsewhere ({choice})",
                    )  # fmt: skip
                    said.append(f"{where}: stays, no room elsewhere ({choice})")
                    continue
                moved = placing.replica_create(deployment, choice)
                _launch(
                    moved, source=source, actor=user,
                    message=f"replaces {replica.label} on {host.name}, which is drained: placed on "
                    f"{moved.host.name} GPU(s) {placing.gpus_words(moved)}; {replica.label} goes once it is ready",
                )  # fmt: skip
                said.append(f"{where}: moving to {moved.host.name} as {moved.label}")
        if resting:
            deployment_converge(deployment_id=deployment_id, source=source, actor=user)
    events.record(
        kind="host.drain", source=source, actor=user, host=host,
        message="drained: " + ("; ".join(said) if said else "no replica to move"),
    )  # fmt: skip
    return said


def replace_lost(*, source: str) -> list[Replica]:
    """Mark lost the replicas of hosts that have not beaten for
    GANTRY_HOST_LOST_GRACE_S (not on a first missed beat: a host that flaps
    within the grace causes no churn), then converge every deployment short of
    replicas: replacements start on hosts with room. A deployment that fits
    nowhere now says so on its timeline (once per lost replica) and is tried
    again at the next sweep. Returns the replicas found lost now."""
    lost = _mark_lost(source=source, grace_s=settings.GANTRY_HOST_LOST_GRACE_S)
    # Only those short of replicas: one whose replacements already run costs nothing per sweep.
    alive = Q(replica_set__desired_state=DesiredState.RUNNING) & ~Q(replica_set__status__in=[S.LOST, *states.AT_REST])
    short = (
        Deployment.objects.filter(desired_state=DesiredState.RUNNING)
        .filter(Exists(Replica.objects.filter(deployment=OuterRef("pk"), status=S.LOST)))
        .annotate(alive=Count("replica_set", filter=alive))
        .filter(alive__lt=F("replicas"))
    )
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
