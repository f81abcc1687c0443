"""The deployments app's status tables, and the only code that changes them.

Four state machines live here, each a table of allowed moves: replicas,
engine builds, checkpoint inspections and deployment revisions. A move is a
compare-and-swap update (``filter(pk=…, status=current).update(…)``): if the
row changed under us, or the table does not allow the move, nothing is written
and ``InvalidTransition`` is raised. Replica and build moves also append an
event, published once the transaction commits. A deployment's status is not a
machine of its own: it sums up its replicas' (deployment_sync). Builds are a job kind
(core.jobs, the shape every job shares); load tests, the other one,
keep their table in loadtests.models and move through
loadtests.services.run_transition. Nothing else writes a status field.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from common.errors import InvalidTransition, NotFound
from core import events, jobs
from deployments import selectors
from deployments.models import BuildStatus as B
from deployments.models import (
    Deployment,
    DeploymentRevision,
    DesiredState,
    EngineBuild,
    ModelDownload,
    RegisteredModel,
    Replica,
)
from deployments.models import DeploymentStatus as S
from deployments.models import DownloadStatus as D
from deployments.models import Inspection as I
from deployments.models import RevisionStatus as R

# --- replicas and their deployment ---------------------------------------------------

# A replica's moves. A deployment's own status is not moved: it sums up its
# replicas' (deployment_status_of) whenever one of them moves.
ALLOWED: dict[str, frozenset[str]] = {
    S.PENDING: frozenset({S.LAUNCHING, S.STOPPED}),
    S.LAUNCHING: frozenset({S.FETCHING, S.LOADING, S.FAILED, S.STOPPING, S.LOST}),
    # Its host lacks a hub model: launching again once the download succeeded, failed if it did not.
    S.FETCHING: frozenset({S.LAUNCHING, S.FAILED, S.STOPPING, S.LOST}),
    S.LOADING: frozenset({S.READY, S.FAILED, S.STOPPING, S.LOST}),
    S.READY: frozenset({S.DEGRADED, S.FAILED, S.STOPPING, S.UPDATING, S.LOST}),
    S.UPDATING: frozenset({S.READY, S.FAILED, S.STOPPING, S.LOST}),
    S.DEGRADED: frozenset({S.READY, S.FAILED, S.STOPPING, S.LOST}),
    S.STOPPING: frozenset({S.STOPPED, S.FAILED, S.LOST}),
    S.STOPPED: frozenset({S.LAUNCHING}),
    S.FAILED: frozenset({S.LAUNCHING, S.STOPPING, S.STOPPED}),
    # Its host stopped beating. Back, it says what its server is doing; or the
    # replica is stopped (a stop asked meanwhile, or a replacement took its place).
    S.LOST: frozenset({S.READY, S.DEGRADED, S.FAILED, S.STOPPING, S.STOPPED}),
}

# States in which no server is running and none is being started: a launch or
# stop task that finds its replica here has nothing left to do.
AT_REST = frozenset({S.PENDING, S.STOPPED, S.FAILED})
# States in which a server process may exist on the host.
# (A fetching replica's server is about to start: it is stopped like a launching one.)
ACTIVE = frozenset({S.LAUNCHING, S.FETCHING, S.LOADING, S.READY, S.UPDATING, S.DEGRADED, S.STOPPING})
# States a server keeps running in; a crash from any of them is noticed by reconcile.
SERVING = frozenset({S.LOADING, S.READY, S.UPDATING, S.DEGRADED})
# States in which a replica answers requests (the gateway routes to these).
ANSWERING = frozenset({S.READY, S.DEGRADED})


def sources_of(target: str) -> frozenset[str]:
    """Every replica status from which ``target`` may be reached."""
    return frozenset(src for src, targets in ALLOWED.items() if target in targets)


def is_allowed(current: str, target: str) -> bool:
    return target in ALLOWED.get(current, frozenset())


def deployment_actions(status: str) -> dict[str, bool]:
    """What a person may ask of a deployment in ``status`` now; the browser
    enables its buttons from this, so it keeps no copy of the table."""
    return {
        "start": status in AT_REST,
        "stop": status in ACTIVE - {S.STOPPING} or status == S.FAILED,
        "restart": status in (S.READY, S.DEGRADED, S.FAILED),
        "change": status in (S.READY, S.DEGRADED) or status in AT_REST,
        "rollback": status in (S.READY, S.DEGRADED) or status in AT_REST,
        "scale": status not in (S.STOPPING, S.UPDATING),
        "delete": status in AT_REST,
    }


def deployment_status_of(statuses: list[str], *, wanted: int, desired: str, current: str) -> str:
    """A deployment's status from its replicas' (those meant to run, while it is
    wanted running): ready with all ``wanted`` replicas ready, degraded while
    some serve, else the furthest any got; stopping until every server is gone."""
    count = {status: statuses.count(status) for status in set(statuses)}
    if count.get(S.UPDATING):
        return S.UPDATING
    if desired == DesiredState.RUNNING:
        if count.get(S.READY, 0) >= wanted:
            return S.READY
        for found, status in (
            (count.get(S.READY, 0) + count.get(S.DEGRADED, 0), S.DEGRADED),
            (count.get(S.LOADING), S.LOADING),
            (count.get(S.LAUNCHING, 0) + count.get(S.FETCHING, 0) + count.get(S.PENDING, 0), S.LAUNCHING),
            (count.get(S.STOPPING), S.STOPPING),
            (count.get(S.FAILED, 0) + count.get(S.LOST, 0), S.FAILED),
        ):
            if found:
                return status
        return S.STOPPED if statuses else current
    if any(status in ACTIVE for status in statuses):
        return S.STOPPING
    if count.get(S.FAILED):
        return S.FAILED
    return S.STOPPED if statuses else current


def _summary(deployment: Deployment, replicas: list[Replica], moved: Replica, message: str) -> str:
    if deployment.replicas == 1 and len(replicas) <= 1:
        return message
    ready = sum(1 for replica in replicas if replica.status == S.READY)
    return f"{ready} of {deployment.replicas} replicas ready; {moved.label} on {moved.host.name}: {message}"


def deployment_sync(*, deployment_id: int, source: str, actor: Any = None, moved: Replica | None = None,
                    message: str = "", data: dict[str, Any] | None = None) -> Deployment:  # fmt: skip
    """Sum the deployment's status up from its replicas (in the caller's
    transaction, the deployment's row locked) and, when it changed, say so on
    its timeline."""
    deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
    if deployment is None:
        # A joined host that has just removed its last replica of it may no longer write
        # it (hosts.grants): the hosts still serving it sum it up at their next move.
        return Deployment.objects.get(pk=deployment_id)
    replicas = list(Replica.objects.select_related("host").filter(deployment_id=deployment_id))
    counted = [
        replica.status
        for replica in replicas
        if deployment.desired_state != DesiredState.RUNNING or replica.desired_state == DesiredState.RUNNING
    ]
    status = deployment_status_of(
        counted, wanted=deployment.replicas, desired=deployment.desired_state, current=deployment.status
    )
    words = _summary(deployment, replicas, moved, message) if moved is not None else message
    previous = deployment.status
    if status == previous:
        if words and words != deployment.status_message:
            Deployment.objects.filter(pk=deployment_id).update(status_message=words)
            deployment.status_message = words
        return deployment
    Deployment.objects.filter(pk=deployment_id).update(
        status=status, status_message=words, status_changed_at=timezone.now()
    )
    deployment.status, deployment.status_message = status, words
    events.record(
        kind="deployment.status",
        source=source,
        actor=actor,
        deployment=deployment,
        from_status=previous,
        to_status=status,
        message=words,
        data=data,
    )
    return deployment


def replica_transition(
    *,
    replica_id: int,
    to: str,
    source: str,
    message: str = "",
    actor: Any = None,
    only_from: frozenset[str] | None = None,
    runtime_handle: str | None = None,
    data: dict[str, Any] | None = None,
    **fields: Any,
) -> Replica:
    """Move a replica to ``to`` if the table allows it from its current status,
    then sum its deployment's status up again.

    ``only_from`` narrows the allowed sources further (a worker that finished
    loading only moves ``loading`` to ``ready``). A compare-and-swap update
    makes concurrent callers safe: if the row changed under us, nothing is
    written and InvalidTransition is raised. ``fields``: more of the replica's
    columns, written in the same update.
    """
    allowed_from = sources_of(to)
    if only_from is not None:
        allowed_from = allowed_from & only_from
    with transaction.atomic():
        row = Replica.objects.filter(pk=replica_id).values_list("deployment_id", "status").first()
        if row is None:
            raise NotFound(f"replica {replica_id} does not exist")
        deployment_id, current = row
        # The deployment's row first, always: every writer locks it before its replicas.
        Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        fields.update(status=to, status_message=message, status_changed_at=timezone.now())
        if runtime_handle is not None:
            fields["runtime_handle"] = runtime_handle
        changed = Replica.objects.filter(pk=replica_id, status=current, status__in=allowed_from).update(**fields)
        if not changed:
            raise InvalidTransition(f"cannot go from {current} to {to}")
        replica = Replica.objects.select_related("host", "deployment").get(pk=replica_id)
        events.record(
            kind="replica.status",
            source=source,
            actor=actor,
            deployment=replica.deployment,
            host=replica.host,
            from_status=current,
            to_status=to,
            message=f"{replica.label} on {replica.host.name}: {message}" if message else replica.label,
            data={"replica": replica.serial, "replica_id": replica.pk, **(data or {})},
        )
        deployment_sync(
            deployment_id=deployment_id, source=source, actor=actor, moved=replica, message=message, data=data
        )
    return replica


# --- engine builds ----------------------------------------------------------------

BUILD_ALLOWED: dict[str, frozenset[str]] = {
    B.PENDING: frozenset({B.RUNNING, B.CANCELLED, B.FAILED}),
    B.RUNNING: frozenset({B.CANCELLING, B.SUCCEEDED, B.FAILED}),
    B.CANCELLING: frozenset({B.CANCELLED, B.FAILED}),
}
BUILD_TERMINAL = frozenset({B.SUCCEEDED, B.FAILED, B.CANCELLED})
BUILD_ACTIVE = frozenset({B.PENDING, B.RUNNING, B.CANCELLING})


def build_actions(status: str) -> dict[str, bool]:
    """What a person may ask of a build in ``status`` now."""
    return {"cancel": status in (B.PENDING, B.RUNNING)}


def _build_moved(move: jobs.Move) -> EngineBuild:
    build = selectors.build_get(move.job_id)
    events.record(
        kind="build.status",
        source=move.source,
        actor=move.actor,
        build=build,
        model=build.model,
        from_status=move.previous,
        to_status=move.to,
        message=move.message,
        data={k: v for k, v in move.fields.items() if k in ("phase", "exit_code", "hint")},
    )
    return build


BUILD = jobs.register(
    jobs.JobKind(
        name="build",
        model=EngineBuild,
        allowed=BUILD_ALLOWED,
        terminal=BUILD_TERMINAL,
        after=_build_moved,
        stamps=lambda to, now: {"heartbeat_at": now},
    )
)


def build_transition(
    *, build_id: int, to: str, source: str, message: str = "", actor: Any = None, **fields: Any
) -> EngineBuild:
    """Move a build to ``to`` if ``BUILD_ALLOWED`` permits it from its current status
    (compare-and-swap, core.jobs), with ``fields`` written in the same update."""
    return jobs.job_transition(BUILD, job_id=build_id, to=to, source=source, message=message, actor=actor, **fields)


# --- hub downloads -----------------------------------------------------------------

DOWNLOAD_ALLOWED: dict[str, frozenset[str]] = {
    D.PENDING: frozenset({D.RUNNING, D.CANCELLED, D.FAILED}),
    # Running again: a new worker resumes what a dead one left (its partial files stay).
    D.RUNNING: frozenset({D.RUNNING, D.CANCELLING, D.SUCCEEDED, D.FAILED}),
    D.CANCELLING: frozenset({D.CANCELLED, D.FAILED}),
}
DOWNLOAD_TERMINAL = frozenset({D.SUCCEEDED, D.FAILED, D.CANCELLED})
DOWNLOAD_ACTIVE = frozenset({D.PENDING, D.RUNNING, D.CANCELLING})


def _download_moved(move: jobs.Move) -> ModelDownload:
    download = ModelDownload.objects.select_related("model", "host").get(pk=move.job_id)
    events.record(
        kind="model.download",
        source=move.source,
        actor=move.actor,
        model=download.model,
        host=download.host,
        from_status=move.previous,
        to_status=move.to,
        message=f"{download.model.name} on {download.host.name}: {move.message}",
        data={"download": download.pk},
    )
    return download


DOWNLOAD = jobs.register(
    jobs.JobKind(
        name="download",
        model=ModelDownload,
        allowed=DOWNLOAD_ALLOWED,
        terminal=DOWNLOAD_TERMINAL,
        after=_download_moved,
        stamps=lambda to, now: {"heartbeat_at": now, **({"started_at": now} if to == D.RUNNING else {})},
    )
)


def download_transition(
    *, download_id: int, to: str, source: str, message: str = "", actor: Any = None, **fields: Any
) -> ModelDownload:
    """Move a hub download to ``to`` if ``DOWNLOAD_ALLOWED`` permits it (core.jobs)."""
    return jobs.job_transition(
        DOWNLOAD, job_id=download_id, to=to, source=source, message=message, actor=actor, **fields
    )


# --- checkpoint inspections -------------------------------------------------------

INSPECTION_ALLOWED: dict[str, frozenset[str]] = {
    I.PENDING: frozenset({I.READY, I.FAILED}),
    # A hub model whose first download failed is downloaded (and inspected) again.
    I.FAILED: frozenset({I.PENDING}),
}


def inspection_transition(*, model_id: int, to: str, message: str = "", **fields: Any) -> bool:
    """Record an inspection's outcome (with what it found in ``fields``); False when
    the model is gone or was already inspected (a task delivered twice)."""
    allowed_from = [src for src, targets in INSPECTION_ALLOWED.items() if to in targets]
    changed = RegisteredModel.objects.filter(pk=model_id, inspection__in=allowed_from).update(
        inspection=to, inspection_message=message, **fields
    )
    return bool(changed)


# --- deployment revisions ---------------------------------------------------------

REVISION_ALLOWED: dict[str, frozenset[str]] = {
    R.CURRENT: frozenset({R.SUPERSEDED, R.FAILED}),
    R.SUPERSEDED: frozenset({R.CURRENT}),
}


def revision_transition(*, deployment_id: int, generation: int, to: str, message: str | None = None) -> None:
    """Move one generation's revision to ``to``; InvalidTransition when the table forbids it."""
    allowed_from = [src for src, targets in REVISION_ALLOWED.items() if to in targets]
    fields: dict[str, Any] = {"status": to}
    if message is not None:
        fields["message"] = message
    changed = DeploymentRevision.objects.filter(
        deployment_id=deployment_id, generation=generation, status__in=allowed_from
    ).update(**fields)
    if not changed:
        raise InvalidTransition(f"revision {generation} of deployment {deployment_id} cannot become {to}")


def revision_supersede_current(*, deployment_id: int) -> None:
    """The current revision (if any) stops being current: a new generation takes its place."""
    DeploymentRevision.objects.filter(deployment_id=deployment_id, status=R.CURRENT).update(status=R.SUPERSEDED)
