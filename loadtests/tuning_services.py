"""Tuning runs as people and workers ask for them: start one (checked against
the deployment, confirmed when real clients use its aliases, never beside a
load test or another run), cancel it, apply its best plan; and the worker's
writes while it searches (claim, its gateway key, each trial, finish) with the
reaper for runs whose worker went quiet.

A run ends with its deployment back at the settings it started from (a new
generation holding them, if trials changed them), however it ends: finished,
cancelled, failed or reaped; or, when it finished and was asked to
(``end_on: best``), on its best trial's plan where that met every target, in
the same one roll-out. A tuning run is a run kind (loadtests.runs, which
writes what every run kind shares); its status moves only through
``tuning_transition``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from common.errors import (
    GantryError,
    InvalidTransition,
    NotFound,
    NothingToChange,
    ValidationFailed,
)
from core import events, queues
from core.permissions import require_operator
from deployments.backends.memory import placement_gpus
from deployments.gpu_plan import share_of
from deployments.models import Deployment, DeploymentStatus
from deployments.services import deployments as deployment_services
from deployments.services.placements import (
    placement_rows,
    placements_snapshot,
    placements_validate,
    spec_from_snapshot,
)
from gateway.models import Alias
from hosts import outbox
from loadtests import runs, tuning
from loadtests.models import ACTIVE, LoadTest, RunStatus, TrialStatus, TuningRun, TuningTrial


def _holder(deployment_id: int) -> str:
    holding = Q(status__in=ACTIVE) | Q(restore_pending=True)  # until the settings it ends on hold
    run = TuningRun.objects.filter(holding, deployment_id=deployment_id).values_list("pk", flat=True).first()
    return f"tuning run {run}" if run is not None else ""


TUNING_RUN = runs.register(
    runs.RunKind(
        name="tuning run",
        event="tuning",
        model=TuningRun,
        task=queues.RUN_TUNING,
        key_name=runs.KEY_NAME_PREFIX + "(tuning run {})",
        key_aliases=lambda run: [entry["model"] for entry in run.spec["mix"]],
        key_valid_s=lambda run: run.spec["budget_s"] + runs.KEY_VALID_S,
        about=lambda run: (f"tuning run {run.pk}", {"tuning_run": run.pk}),
        kept="the trials it measured",
        holder=_holder,
    )
)


def tuning_transition(
    *, run_id: int, to: str, source: str, message: str = "", actor: Any = None, **fields: Any
) -> TuningRun:
    """Move run ``run_id`` to ``to`` if the table allows it (``fields`` written
    with it), on its deployment's timeline."""
    return runs.transition(TUNING_RUN, run_id=run_id, to=to, source=source, message=message, actor=actor, **fields)


def publish(run: TuningRun) -> None:
    """Tell the deployment's pages where the run is."""
    runs.publish(TUNING_RUN, run)


def tuning_create(*, deployment_id: int, spec: dict[str, Any], confirm: bool = False, user: Any = None) -> TuningRun:
    """Ask the deployment's host to tune it under ``spec``'s mix. Refused by
    field when the spec does not fit the deployment; refused while a load test
    or another tuning run is active there, or while the deployment is not
    ready; refused with code confirmation_required, until ``confirm``, when
    live gateway keys other than load tests' may use an alias of the mix (their
    requests would slow, and each trial reloads models)."""
    require_operator(user)
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        placements = dict(deployment.placements.values_list("triton_name", "registered_model__kind"))
        aliases = dict(Alias.objects.filter(deployment=deployment).values_list("name", "triton_name"))
        checked = tuning.check(spec, placements=placements, aliases=aliases)
        home = deployment.replica_set.select_related("host").filter(status=DeploymentStatus.READY).order_by("serial")
        home = home.first()
        if deployment.status != DeploymentStatus.READY or home is None:
            raise InvalidTransition(f"{deployment.name} is {deployment.status}; a tuning run needs it ready")
        testing = LoadTest.objects.filter(deployment=deployment, status__in=ACTIVE).first()
        if testing is not None:
            raise InvalidTransition(f"load test {testing.pk} is {testing.status} on {deployment.name}: one at a time")
        users = sorted({key.name for entry in checked["mix"]
                        for key in runs.production_keys(Alias.objects.get(name=entry["model"]))})  # fmt: skip
        runs.require_confirmed(users, confirm=confirm, uses="the mix's models",
                               why="each trial reloads models and loads them at the mix's rates")  # fmt: skip
        try:
            with transaction.atomic():
                run = TuningRun.objects.create(
                    deployment=deployment,
                    deployment_name=deployment.name,
                    host=home.host,
                    spec=checked,
                    start_generation=deployment.generation,
                    start_plan=placements_snapshot(deployment),
                    created_by=events.signed_in(user),
                )
        except IntegrityError:
            raise InvalidTransition(f"a tuning run is already active on {deployment.name}: one at a time") from None
        events.record(
            kind="tuning.queued",
            source=events.source_of(user),
            actor=user,
            deployment=deployment,
            to_status=RunStatus.QUEUED,
            message=f"tuning run {run.pk} asked for: {_describe(checked)}",
            data={"tuning_run": run.pk, "confirmed": bool(users)},
        )
        key = tuning_key_issue(run_id=run.pk)
        outbox.enqueue_on_commit(queues.RUN_TUNING, host_name=home.host.name, args=[run.pk, key])
    return run


def _describe(spec: dict[str, Any]) -> str:
    mix = ", ".join(f"{entry['model']} at {entry['rate']:g}/s" for entry in spec["mix"])
    return (
        f"{mix}; {spec['search']} search of {spec['grid_size']} plan(s), at most {spec['max_trials']} trial(s) "
        f"of {spec['trial_s']} s within {spec['budget_s']} s"
    )


def tuning_cancel(*, run_id: int, user: Any = None) -> TuningRun:
    """A queued run is cancelled at once; a running one is asked to stop (its
    worker stops the load, keeps the trials it measured and puts the starting
    settings back)."""
    return runs.cancel(TUNING_RUN, run_id=run_id, user=user)


def tuning_delete(*, run_id: int, user: Any = None) -> None:
    """Forget a finished run and its trials (refused while it is active)."""
    runs.delete(TUNING_RUN, run_id=run_id, user=user)


def tuning_apply(*, run_id: int, trial: int | None = None, user: Any = None) -> TuningRun:
    """Make a trial's plan (the best measured one unless ``trial`` is named) the
    deployment's next generation, rolled out as any change is."""
    require_operator(user)
    run = runs.get(TUNING_RUN, run_id)
    if run.status in ACTIVE:
        raise InvalidTransition(f"tuning run {run_id} is {run.status}; apply a plan when it has ended")
    if run.deployment_id is None:
        raise InvalidTransition(f"{run.deployment_name} was deleted")
    trials = list(run.trials.all())
    chosen = tuning.best(trials) if trial is None else next((t for t in trials if t.number == trial), None)
    if chosen is None or chosen.goodput is None:
        what = "no trial was measured" if trial is None else f"trial {trial} was not measured"
        raise ValidationFailed({"trial": f"{what}: nothing to apply"})
    deployment_services.deployment_change(
        deployment_id=run.deployment_id,
        placements=[spec_from_snapshot(item) for item in chosen.plan],
        user=user,
        reason=f"tuning run {run.pk}, trial {chosen.number} ({chosen.goodput:g} good requests/s)",
    )
    generation = Deployment.objects.values_list("generation", flat=True).get(pk=run.deployment_id)
    TuningRun.objects.filter(pk=run.pk).update(applied_generation=generation)
    return runs.get(TUNING_RUN, run_id)


# --- the worker's writes ------------------------------------------------------


def tuning_claim(*, run_id: int, source: str) -> TuningRun | None:
    """The worker takes a queued run (None when it is no longer queued)."""
    return runs.claim(TUNING_RUN, run_id=run_id, source=source, message="search starting")


def tuning_report(*, run_id: int, progress: dict[str, Any]) -> str:
    """The worker's heartbeat; returns the run's status now (cancelling means stop)."""
    return runs.report(TUNING_RUN, run_id=run_id, progress=progress)


def tuning_key_issue(*, run_id: int) -> str:
    """The run's gateway key, scoped to the mix's aliases, valid for its budget
    and then some (loadtests.runs.key_issue)."""
    return runs.key_issue(TUNING_RUN, run_id=run_id)


def trial_start(*, run_id: int, number: int, params: dict[str, Any]) -> TuningTrial:
    """Record trial ``number`` with its values and the plan they make, and put
    the plan to the deployment: checked like any change (the per-GPU plan
    included), and pruned before it starts when it cannot be placed; else
    rolled out as a new generation. A trial recorded before (a worker that
    restarted) is taken up again."""
    run = TuningRun.objects.select_related("deployment").get(pk=run_id)
    plan = tuning.plan_of(run.start_plan, params)
    trial, _ = TuningTrial.objects.update_or_create(
        run=run, number=number, defaults={"params": params, "plan": plan, "status": TrialStatus.RUNNING}
    )
    deployment = run.deployment
    if deployment is None:
        raise InvalidTransition(f"{run.deployment_name} was deleted")
    specs = [spec_from_snapshot(item) for item in plan]
    try:
        host = deployment_services.reference_host(deployment)
        resolved = placements_validate(host=host, specs=specs, runtime=deployment.runtime, image=deployment.image)
        gpus = list(host.gpus.values_list("index", flat=True))
        share = sum(share_of(row) * len(placement_gpus(row, gpus)) for row in placement_rows(resolved))
        TuningTrial.objects.filter(pk=trial.pk).update(gpu_share=round(share, 4))
        deployment_services.deployment_change(
            deployment_id=deployment.pk,
            placements=specs,
            user=None,  # the run's host makes the change; its asker was checked when it was asked for
            reason=f"tuning run {run.pk}, trial {number}",
        )
    except NothingToChange:  # the plan the deployment holds now: measure it as it is
        TuningTrial.objects.filter(pk=trial.pk).update(generation=deployment.generation)
        return TuningTrial.objects.get(pk=trial.pk)
    except ValidationFailed as refused:
        rules = "; ".join(f"{field}: {' '.join(messages)}" for field, messages in refused.errors.items())
        return trial_end(trial_id=trial.pk, status=TrialStatus.PRUNED, reason=rules)
    generation = Deployment.objects.values_list("generation", flat=True).get(pk=deployment.pk)
    TuningTrial.objects.filter(pk=trial.pk).update(generation=generation)
    return TuningTrial.objects.get(pk=trial.pk)


def trial_end(
    *, trial_id: int, status: str, reason: str = "", figures: dict[str, Any] | None = None,
    goodput: float | None = None,
) -> TuningTrial:  # fmt: skip
    """A trial measured (its figures and goodput), pruned or failed (why), on the timeline."""
    TuningTrial.objects.filter(pk=trial_id).update(
        status=status, reason=reason, figures=figures or {}, goodput=goodput, finished_at=timezone.now()
    )
    trial = TuningTrial.objects.select_related("run").get(pk=trial_id)
    said = {
        TrialStatus.MEASURED: f"{goodput:g} good requests/s" if goodput is not None else "measured",
        TrialStatus.PRUNED: f"pruned: {reason}",
        TrialStatus.FAILED: f"failed: {reason}",
    }[status]
    events.record(
        kind=f"tuning.trial.{status}",
        source="worker",
        deployment=trial.run.deployment,
        message=f"tuning run {trial.run_id}, trial {trial.number} ({_params(trial.params)}): {said}",
        data={"tuning_run": trial.run_id, "trial": trial.number, "params": trial.params},
    )
    publish(trial.run)
    return trial


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{name}={value}" for name, value in params.items())


def tuning_finish(*, run_id: int, status: str, message: str, source: str) -> TuningRun | None:
    """End a run as succeeded, failed or cancelled, with the deployment first put
    on the settings it ends on (``tuning_settle``); None when it had already ended."""
    run = TuningRun.objects.filter(pk=run_id).first()
    if run is None or run.status not in ACTIVE:
        return None
    TuningTrial.objects.filter(run=run, status=TrialStatus.RUNNING).update(
        status=TrialStatus.FAILED, reason=f"the run ended ({status}) before it was measured", finished_at=timezone.now()
    )
    if status == RunStatus.SUCCEEDED and run.status == RunStatus.CANCELLING:
        status = RunStatus.CANCELLED
    settled = tuning_settle(run, status)
    said = settled.said if settled.held else f"{settled.said}; the control plane tries again until they are"
    try:
        return tuning_transition(run_id=run_id, to=status, source=source, message=f"{message}; {said}",
                                 restore_pending=not settled.held, applied_generation=settled.applied)  # fmt: skip
    except InvalidTransition:
        return None


class Settled(NamedTuple):
    held: bool  # the deployment holds the settings the run ends on (or is gone)
    said: str  # what was done, in words
    applied: int | None = None  # the generation holding the winner's plan, when the run ended on it


def tuning_settle(run: TuningRun, status: str | None = None) -> Settled:
    """Put the deployment on the settings the run ends on (``status``, its own
    by default), in one roll-out, none when it holds them already: its best
    trial's plan when the run finished, was asked to end on it (spec
    ``end_on``) and that trial met every target; else the settings it started
    from."""
    if run.deployment_id is None:
        return Settled(True, "the deployment was deleted")
    deployment = Deployment.objects.get(pk=run.deployment_id)
    asked = (status or run.status) == RunStatus.SUCCEEDED and run.spec.get("end_on") == tuning.END_ON_BEST
    chosen = tuning.best(list(run.trials.all())) if asked else None
    winner = chosen if tuning.met(chosen) else None
    if winner is None:
        plan, missed = run.start_plan, "no plan met every target, so " if asked else ""
        holds, blocked = "holds its starting settings", "the starting settings could not be put back yet"
        done = f"the settings of generation {run.start_generation} are back"
        reason = f"the settings of generation {run.start_generation} back"
    else:
        reason = f"trial {winner.number}'s plan ({winner.goodput:g} good requests/s)"
        plan, missed = winner.plan, ""
        holds, blocked, done = f"holds {reason}", f"{reason} could not be put in place yet", f"{reason} is in place"
    try:
        deployment_services.deployment_change(
            deployment_id=run.deployment_id,
            placements=[spec_from_snapshot(item) for item in plan],
            user=None,  # the run's host makes the change; its asker was checked when it was asked for
            reason=f"tuning run {run.pk} ended: {reason}",
        )
    except NothingToChange:
        applied = None if winner is None else deployment.generation
        return Settled(True, f"{missed}{deployment.name} {holds} (generation {deployment.generation})", applied)
    except GantryError as refused:  # not changeable now (mid-roll, stopped), or a plan no longer placeable
        return Settled(False, f"{missed}{blocked}: {refused}")
    generation = Deployment.objects.values_list("generation", flat=True).get(pk=run.deployment_id)
    return Settled(True, f"{missed}{done}, as generation {generation}", None if winner is None else generation)


def tunings_restore_pending() -> int:
    """Try again to put ended runs' deployments on the settings they end on,
    where they could not be at the end (the beat, every 30 s); how many hold
    them now, each said on the timeline."""
    back = 0
    for run in TuningRun.objects.filter(restore_pending=True).exclude(status__in=ACTIVE):
        settled = tuning_settle(run)
        if not settled.held:
            continue
        TuningRun.objects.filter(pk=run.pk).update(
            restore_pending=False,
            status_message=f"{run.status_message}; then {settled.said}",
            applied_generation=settled.applied,
        )
        events.record(
            kind="tuning.restored",
            source="system",
            deployment=run.deployment,
            message=f"tuning run {run.pk}: {settled.said}",
            data={"tuning_run": run.pk},
        )
        publish(TuningRun.objects.get(pk=run.pk))
        back += 1
    return back


def tunings_reap(*, stale_after_s: int = runs.STALE_AFTER_S) -> int:
    """Fail runs whose worker stopped reporting (killed, or its host went away),
    putting their deployments back; the trials they measured are kept."""
    return runs.reap(TUNING_RUN, tuning_finish, stale_after_s=stale_after_s)
