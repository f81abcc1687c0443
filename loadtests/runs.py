"""What every run a host carries out for a person has, written once: load tests
and tuning runs, and a third kind as one more ``RunKind``.

A run's status moves through core.jobs (the table is
loadtests.models.ALLOWED) with its deployment's row locked first; each move is
on the deployment's timeline and told to its pages. The worker claims a queued
run and reports a heartbeat; a person cancels or deletes it. The control plane
issues the run's gateway key with its task (a host's credentials may not make
keys) and the beat revokes it once the run has ended; a queued run whose task
was lost is sent again; a run whose worker went quiet is reaped.
"""

from __future__ import annotations

import datetime as dt
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import models, transaction
from django.db.models import Q
from django.utils import timezone

from common.errors import ConfirmationRequired, InvalidTransition, NotFound
from core import events, jobs
from core.permissions import require_operator
from deployments.models import Deployment
from gateway import services as gateway_services
from gateway.models import Alias, ApiKey
from hosts import outbox
from loadtests.models import ACTIVE, ALLOWED, TERMINAL, RunStatus

# The gateway keys a run makes for itself start so; they are not "real clients".
KEY_NAME_PREFIX = "load test "
# A run's key outlives its longest run; the beat revokes it once the run has ended.
KEY_VALID_S = 2 * 24 * 3600
# A run whose worker has not reported for this long is failed by the beat's reaper.
STALE_AFTER_S = 120


@dataclass(frozen=True)
class RunKind:
    name: str  # as messages say it: "load test"
    event: str  # the timeline's and the pages' word: loadtest.running, {"type": "loadtest"}
    model: type[models.Model]
    task: str  # the host task that carries it out (core.queues)
    key_name: str  # its gateway key's name, "{}" for the run's id
    key_aliases: Callable[[Any], list[str]]  # the aliases its key may name
    key_valid_s: Callable[[Any], int]  # how long its key lives
    about: Callable[[Any], tuple[str, dict[str, Any]]]  # the run in words on its timeline, and the events' data
    kept: str  # what a run that dies keeps: "the steps it finished"
    holder: Callable[[int], str] | None = None  # see core.jobs.JobKind.holder
    job: jobs.JobKind = field(init=False, repr=False)

    def __post_init__(self) -> None:
        job = jobs.JobKind(
            name=self.name,
            model=self.model,
            allowed=ALLOWED,
            terminal=TERMINAL,
            after=functools.partial(_moved, self),
            stamps=lambda to, now: {"started_at": now, "heartbeat_at": now} if to == RunStatus.RUNNING else {},
            lock_first=functools.partial(_lock_deployment, self.model),
            holder=self.holder,
        )
        object.__setattr__(self, "job", jobs.register(job))


KINDS: dict[str, RunKind] = {}


def register(kind: RunKind) -> RunKind:
    """Add a run kind once, where its app defines it: its task is a host task
    the outbox knows (hosts.outbox.HostTask), sent again when lost."""
    KINDS[kind.name] = kind
    outbox.register(outbox.HostTask(kind.task, resend_waiting=functools.partial(_resend, kind)))
    return kind


def _lock_deployment(model: type[models.Model], run_id: int) -> None:
    # The deployment's row first, as a run's create locks them: a move takes the run
    # out of (or into) the one-active-run index, which a concurrent create waits
    # on while holding the deployment; the other order deadlocks.
    deployment_id = model.objects.filter(pk=run_id).values_list("deployment_id", flat=True).first()
    Deployment.objects.select_for_update().filter(pk=deployment_id).first()


def _moved(kind: RunKind, move: jobs.Move) -> Any:
    run = kind.model.objects.select_related("deployment").get(pk=move.job_id)
    words, data = kind.about(run)
    events.record(
        kind=f"{kind.event}.{move.to}",
        source=move.source,
        actor=move.actor,
        deployment=run.deployment,
        from_status=move.previous,
        to_status=move.to,
        message=move.message or f"{words} is {move.to}",
        data=data,
    )
    transaction.on_commit(lambda: publish(kind, run))
    return run


def transition(
    kind: RunKind, *, run_id: int, to: str, source: str, message: str = "", actor: Any = None, **fields: Any
) -> Any:
    """Move run ``run_id`` to ``to`` if the table allows it from where it is (a
    compare-and-swap, core.jobs), ``fields`` written with it."""
    return jobs.job_transition(kind.job, job_id=run_id, to=to, source=source, message=message, actor=actor, **fields)


def publish(kind: RunKind, run: Any) -> None:
    """Tell the deployment's pages where the run is."""
    if run.deployment_id is not None:
        payload = {"type": kind.event, "id": run.pk, "status": run.status, "status_message": run.status_message,
                   "progress": run.progress}  # fmt: skip
        events.publish(events.deployment_group(run.deployment_id), payload)


def production_keys(alias: Alias) -> list[ApiKey]:
    """The live gateway keys, other than runs' own, that may use ``alias``: the
    real clients a run would slow."""
    now = timezone.now()
    return list(
        ApiKey.objects.filter(revoked_at__isnull=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .filter(Q(all_aliases=True) | Q(aliases=alias))
        .exclude(name__startswith=KEY_NAME_PREFIX)
        .distinct()
        .order_by("name")
    )


def require_confirmed(keys: list[str], *, confirm: bool, uses: str, why: str) -> None:
    """Refused with code confirmation_required, until ``confirm``, while live
    gateway keys (``keys``, their names) may use ``uses``: ``why`` their
    requests would suffer."""
    if keys and not confirm:
        names = ", ".join(keys[:5]) + (" ..." if len(keys) > 5 else "")
        raise ConfirmationRequired(
            f"{len(keys)} live gateway key(s) may use {uses} ({names}): {why}; send confirm: true to go ahead"
        )


def get(kind: RunKind, run_id: int) -> Any:
    run = kind.model.objects.filter(pk=run_id).first()
    if run is None:
        raise NotFound(f"{kind.name} {run_id} does not exist")
    return run


# --- a person's asks ---------------------------------------------------------------


def cancel(kind: RunKind, *, run_id: int, user: Any = None) -> Any:
    """A queued run is cancelled at once; a running one is asked to stop (its
    worker stops the load and keeps what it measured)."""
    require_operator(user)
    run = get(kind, run_id)
    source = events.source_of(user)
    if run.status == RunStatus.QUEUED:
        return transition(kind, run_id=run_id, to=RunStatus.CANCELLED, source=source, actor=user,
                          message="cancelled before it started")  # fmt: skip
    if run.status == RunStatus.RUNNING:
        return transition(kind, run_id=run_id, to=RunStatus.CANCELLING, source=source, actor=user,
                          message="cancel requested")  # fmt: skip
    raise InvalidTransition(f"{kind.name} {run_id} is {run.status}; only a queued or running one can be cancelled")


def delete(kind: RunKind, *, run_id: int, user: Any = None) -> None:
    """Forget a finished run and what it measured (refused while it is active)."""
    require_operator(user)
    with transaction.atomic():
        run = kind.model.objects.select_for_update().filter(pk=run_id).first()
        if run is None:
            raise NotFound(f"{kind.name} {run_id} does not exist")
        if run.status in ACTIVE:
            raise InvalidTransition(f"{kind.name} {run_id} is {run.status}; cancel it before deleting it")
        run.delete()


# --- the worker's writes -------------------------------------------------------------


def claim(kind: RunKind, *, run_id: int, source: str, message: str) -> Any | None:
    """The worker takes a queued run (None when it is no longer queued: cancelled
    meanwhile, or a second delivery of the same task)."""
    try:
        return transition(kind, run_id=run_id, to=RunStatus.RUNNING, source=source, message=message)
    except (InvalidTransition, NotFound):
        return None


def report(kind: RunKind, *, run_id: int, progress: dict[str, Any], **fields: Any) -> str:
    """The worker's heartbeat (what is under way, and ``fields``); returns the
    run's status now (cancelling means stop)."""
    kind.model.objects.filter(pk=run_id).update(progress=progress, heartbeat_at=timezone.now(), **fields)
    run = kind.model.objects.get(pk=run_id)
    publish(kind, run)
    return run.status


def reap(kind: RunKind, finish: Callable[..., Any], *, stale_after_s: int = STALE_AFTER_S) -> int:
    """Fail runs whose worker stopped reporting (killed, or its host went away)
    through the kind's ``finish``, keeping what they measured; how many."""
    cutoff = timezone.now() - dt.timedelta(seconds=stale_after_s)
    stale = kind.model.objects.filter(status__in=[RunStatus.RUNNING, RunStatus.CANCELLING], heartbeat_at__lt=cutoff)
    message = f"the worker stopped reporting for over {stale_after_s} s (restarted or killed); {kind.kept} are kept"
    return sum(1 for run in stale if finish(run_id=run.pk, status=RunStatus.FAILED, source="system", message=message))


# --- the run's gateway key ------------------------------------------------------------


def key_issue(kind: RunKind, *, run_id: int) -> str:
    """A gateway key for the run's load generators, scoped to its aliases; its
    secret, once. An earlier key of the run (a task sent again) is revoked."""
    run = kind.model.objects.select_related("created_by").get(pk=run_id)
    if run.created_by is None:
        raise InvalidTransition(f"the user who asked for this {kind.name} no longer exists")
    keys_revoke(kind, run_id=run_id)
    return gateway_services.key_create(
        name=kind.key_name.format(run_id),
        user=run.created_by,
        alias_names=kind.key_aliases(run),
        expires_at=timezone.now() + dt.timedelta(seconds=kind.key_valid_s(run)),
    ).secret


def keys_revoke(kind: RunKind, *, run_id: int) -> None:
    """Revoke the gateway keys made for run ``run_id``."""
    live = ApiKey.objects.filter(name=kind.key_name.format(run_id), revoked_at__isnull=True)
    for key_id in live.values_list("pk", flat=True):
        gateway_services.key_revoke(key_id=key_id)


def ended_keys_revoke() -> int:
    """Revoke every run key whose run has ended, or whose run is unknown (the beat
    runs it every heartbeat: a run's end is reported by its host, whose
    credentials may not touch keys). Returns how many were revoked."""
    patterns = [(re.compile(re.escape(kind.key_name).replace(r"\{\}", r"(\d+)")), kind) for kind in KINDS.values()]
    revoked = 0
    for key_id, name in ApiKey.objects.filter(name__startswith=KEY_NAME_PREFIX, revoked_at__isnull=True).values_list(
        "pk", "name"
    ):
        found = next(((m, kind) for pattern, kind in patterns if (m := pattern.fullmatch(name))), None)
        if found is None or not found[1].model.objects.filter(pk=int(found[0][1]), status__in=ACTIVE).exists():
            gateway_services.key_revoke(key_id=key_id)
            revoked += 1
    return revoked


# --- a task that was lost ---------------------------------------------------------------


def redrive(kind: RunKind, *, run_id: int, source: str, message: str) -> bool:
    """Send a queued run's task again (its first may have been lost inside a broker
    that restarted), with a new key; False when it is no longer queued or its
    task still waits in the outbox. A duplicate is harmless: only one worker
    claims the run."""
    with transaction.atomic():
        run = kind.model.objects.select_related("deployment", "host").select_for_update(of=("self",))
        run = run.filter(pk=run_id).first()
        if run is None or run.status != RunStatus.QUEUED or run.host is None:
            return False
        if outbox.is_waiting(kind.task, run.pk):  # before a new key revokes the waiting task's
            return False
        # None from a joined host, whose credentials may not make keys (its worker then fails the run).
        key = [] if settings.GANTRY_JOINED_HOST else [key_issue(kind, run_id=run.pk)]
        return outbox.redrive(kind.task, host_name=run.host.name, args=[run.pk, *key], source=source,
                              message=f"{kind.name} {run.pk}: {message}", deployment=run.deployment)  # fmt: skip


def _resend(kind: RunKind, host_name: str, source: str, message: str) -> list[str]:
    queued = kind.model.objects.filter(host__name=host_name, status=RunStatus.QUEUED).values_list("pk", flat=True)
    return [f"{kind.name} {pk}" for pk in queued if redrive(kind, run_id=pk, source=source, message=message)]
