"""The one shape of a job's state machine: engine builds, load tests, and any
job kind that comes next. Each kind registers once (its model, its table of
allowed moves, its terminal set, and what a move writes and tells beside the
status); ``job_transition`` is the only code that writes a job's status.

A move is a compare-and-swap update (``filter(pk=…, status=current)``) inside
a transaction: if the table does not allow it, or the row changed under us,
nothing is written and ``InvalidTransition`` is raised. A kind may lock other
rows first (always in the same order), and its ``after`` hook records the
move's event (and ends what ends with the job) in the same transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import models, transaction
from django.utils import timezone

from common.errors import InvalidTransition, NotFound


@dataclass(frozen=True)
class Move:
    """One move of one job, as the kind's ``after`` hook sees it."""

    job_id: int
    previous: str
    to: str
    source: str
    message: str
    actor: Any
    fields: dict[str, Any]


@dataclass(frozen=True)
class JobKind:
    name: str  # as the messages say it: "build", "load test"
    model: type[models.Model]
    allowed: dict[str, frozenset[str]]
    terminal: frozenset[str]
    # After the move is written, in its transaction: the event, and what ends with the job; returns the row.
    after: Callable[[Move], Any]
    # What a move to ``to`` writes beside status, status_message and (when terminal) finished_at.
    stamps: Callable[[str, datetime], dict[str, Any]] = lambda to, now: {}
    # Rows to lock before the job's (a fixed order, so two moves never deadlock).
    lock_first: Callable[[int], None] | None = None
    # For a job that holds its deployment's settings while it is active (a tuning run
    # puts its own there and the ones it started from back): which job holds
    # deployment ``id`` ("tuning run 7"), or "".
    holder: Callable[[int], str] | None = None


KINDS: dict[str, JobKind] = {}


def register(kind: JobKind) -> JobKind:
    """Add a job kind to the registry (once, where its app defines it)."""
    if kind.name in KINDS and KINDS[kind.name] is not kind:
        raise ValueError(f"job kind {kind.name!r} is registered twice")
    KINDS[kind.name] = kind
    return kind


def holder_of(deployment_id: int) -> str:
    """The active job that holds the deployment's settings ("tuning run 7"), or ""."""
    for kind in KINDS.values():
        held = kind.holder(deployment_id) if kind.holder is not None else ""
        if held:
            return held
    return ""


def require_unheld(deployment: Any, user: Any) -> None:
    """Refuse a person's change to ``deployment`` while a job holds its settings
    (the job would put its own back over the change when it ends)."""
    if user is None:
        return  # the system's own change: the holding job's, or made for it
    held = holder_of(deployment.pk)
    if held:
        raise InvalidTransition(
            f"{held} holds {deployment.name}'s settings until it ends (it puts its starting ones back): "
            "cancel it, or make the change after it"
        )


def job_transition(
    kind: JobKind, *, job_id: int, to: str, source: str, message: str = "", actor: Any = None, **fields: Any
) -> Any:
    """Move job ``job_id`` of ``kind`` to ``to`` if the kind's table allows it
    from where it is, with ``fields`` written in the same update."""
    with transaction.atomic():
        if kind.lock_first is not None:
            kind.lock_first(job_id)
        current = kind.model.objects.filter(pk=job_id).values_list("status", flat=True).first()
        if current is None:
            raise NotFound(f"{kind.name} {job_id} does not exist")
        if to not in kind.allowed.get(current, frozenset()):
            raise InvalidTransition(f"{kind.name} {job_id} is {current}; it cannot become {to}")
        now = timezone.now()
        update = {"status": to, "status_message": message, **kind.stamps(to, now), **fields}
        if to in kind.terminal:
            update["finished_at"] = now
        if not kind.model.objects.filter(pk=job_id, status=current).update(**update):
            raise InvalidTransition(f"{kind.name} {job_id} changed while moving to {to}")
        return kind.after(Move(job_id, current, to, source, message, actor, fields))
