"""The deployments app's status tables, and the only code that changes them.

Four state machines live here, each a table of allowed moves: deployments,
engine builds, checkpoint inspections and deployment revisions. A move is a
compare-and-swap update (``filter(pk=…, status=current).update(…)``): if the
row changed under us, or the table does not allow the move, nothing is written
and ``InvalidTransition`` is raised. Deployment and build moves also append an
event, published once the transaction commits. Builds are a job kind
(deployments.jobs, the shape every job shares); load tests, the other one,
keep their table in loadtests.models and move through
loadtests.services.run_transition. Nothing else writes a status field.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from common.errors import InvalidTransition, NotFound
from deployments import events, jobs, selectors
from deployments.models import BuildStatus as B
from deployments.models import Deployment, DeploymentRevision, EngineBuild, RegisteredModel
from deployments.models import DeploymentStatus as S
from deployments.models import Inspection as I
from deployments.models import RevisionStatus as R

# --- deployments ---------------------------------------------------------------

ALLOWED: dict[str, frozenset[str]] = {
    S.PENDING: frozenset({S.LAUNCHING}),
    S.LAUNCHING: frozenset({S.LOADING, S.FAILED, S.STOPPING}),
    S.LOADING: frozenset({S.READY, S.FAILED, S.STOPPING}),
    S.READY: frozenset({S.DEGRADED, S.FAILED, S.STOPPING, S.UPDATING}),
    S.UPDATING: frozenset({S.READY, S.FAILED, S.STOPPING}),
    S.DEGRADED: frozenset({S.READY, S.FAILED, S.STOPPING}),
    S.STOPPING: frozenset({S.STOPPED, S.FAILED}),
    S.STOPPED: frozenset({S.LAUNCHING}),
    S.FAILED: frozenset({S.LAUNCHING, S.STOPPING}),
}

# States in which no server is running and none is being started: a launch or
# stop task that finds its deployment here has nothing left to do.
AT_REST = frozenset({S.PENDING, S.STOPPED, S.FAILED})
# States in which a server process may exist on the host.
ACTIVE = frozenset({S.LAUNCHING, S.LOADING, S.READY, S.UPDATING, S.DEGRADED, S.STOPPING})
# States a server keeps running in; a crash from any of them is noticed by reconcile.
SERVING = frozenset({S.LOADING, S.READY, S.UPDATING, S.DEGRADED})


def sources_of(target: str) -> frozenset[str]:
    """Every deployment status from which ``target`` may be reached."""
    return frozenset(src for src, targets in ALLOWED.items() if target in targets)


def is_allowed(current: str, target: str) -> bool:
    return target in ALLOWED.get(current, frozenset())


def deployment_actions(status: str) -> dict[str, bool]:
    """What a person may ask of a deployment in ``status`` now; the browser
    enables its buttons from this, so it keeps no copy of the table."""
    return {
        "start": is_allowed(status, S.LAUNCHING),
        "stop": is_allowed(status, S.STOPPING),
        "restart": status in (S.READY, S.DEGRADED, S.FAILED),
        "change": status == S.READY or status in AT_REST,
        "rollback": status == S.READY or status in AT_REST,
        "delete": status in AT_REST,
    }


def deployment_transition(
    *,
    deployment_id: int,
    to: str,
    source: str,
    message: str = "",
    actor: Any = None,
    only_from: frozenset[str] | None = None,
    runtime_handle: str | None = None,
    desired_state: str | None = None,
    data: dict[str, Any] | None = None,
) -> Deployment:
    """Move a deployment to ``to`` if the table allows it from its current status.

    ``only_from`` narrows the allowed sources further (a worker that finished
    loading only moves ``loading`` to ``ready``). A compare-and-swap update
    makes concurrent callers safe: if the row changed under us, nothing is
    written and InvalidTransition is raised.
    """
    allowed_from = sources_of(to)
    if only_from is not None:
        allowed_from = allowed_from & only_from
    with transaction.atomic():
        current = Deployment.objects.filter(pk=deployment_id).values_list("status", flat=True).first()
        if current is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        fields: dict[str, Any] = {"status": to, "status_message": message, "status_changed_at": timezone.now()}
        if runtime_handle is not None:
            fields["runtime_handle"] = runtime_handle
        if desired_state is not None:
            fields["desired_state"] = desired_state
        changed = Deployment.objects.filter(pk=deployment_id, status=current, status__in=allowed_from).update(**fields)
        if not changed:
            raise InvalidTransition(f"cannot go from {current} to {to}")
        deployment = Deployment.objects.select_related("host").get(pk=deployment_id)
        events.record(
            kind="deployment.status",
            source=source,
            actor=actor,
            deployment=deployment,
            from_status=current,
            to_status=to,
            message=message,
            data=data,
        )
    return deployment


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
    (compare-and-swap, deployments.jobs), with ``fields`` written in the same update."""
    return jobs.job_transition(BUILD, job_id=build_id, to=to, source=source, message=message, actor=actor, **fields)


# --- checkpoint inspections -------------------------------------------------------

INSPECTION_ALLOWED: dict[str, frozenset[str]] = {
    I.PENDING: frozenset({I.READY, I.FAILED}),
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
