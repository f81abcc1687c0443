"""The one runner for a host worker's background jobs (inspect a checkpoint,
launch, stop or update a deployment, run a build).

A job is a function that does its work and returns; when it cannot finish it
raises. ``run_job`` turns whatever it raised into one failed state with a
reason a person can act on, through the job's own ``fail`` callback, so no job
maps exceptions by itself and nothing ends silently:

- ``JobFailed``: the job's own words (and details: a log tail, an exit code,
  or another end status such as cancelled);
- ``ValidationFailed``: the broken rules, as the person would read them;
- other Gantry errors and OS errors: "<what> failed: <why>";
- anything else: a bug; its type and message, and the traceback in the worker log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from django.conf import settings

from common.errors import GantryError, ValidationFailed

log = logging.getLogger(__name__)


def source() -> str:
    """Who acts when this host's worker changes something: for events and timelines."""
    return f"worker:{settings.GANTRY_HOST_NAME}"


class JobFailed(GantryError):
    """A job ends with ``reason``; ``status`` names another end than failed
    (a cancelled build), ``details`` go along (log_tail, exit_code, hint)."""

    def __init__(self, reason: str, *, status: str | None = None, **details: Any) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.details = details


class Fail(Protocol):
    def __call__(self, reason: str, *, status: str | None, details: dict[str, Any]) -> None: ...


def reason_for(what: str, exc: BaseException) -> str:
    """The failure reason a person reads for ``exc`` raised by job ``what``."""
    if isinstance(exc, JobFailed):
        return exc.reason
    if isinstance(exc, ValidationFailed):
        return " ".join(message for messages in exc.errors.values() for message in messages)
    if isinstance(exc, (GantryError, OSError)):
        return f"{what} failed: {exc}"
    return (
        f"{what} failed on an unexpected error ({type(exc).__name__}: {exc}); "
        f"the worker log on {settings.GANTRY_HOST_NAME} has the details"
    )


def run_job(what: str, work: Callable[[], None], *, fail: Fail) -> None:
    """Run ``work``; if it raises, record the failure through ``fail`` and return.

    ``fail`` is expected to be a compare-and-swap transition: when the row has
    already moved on (stopped meanwhile, say), it writes nothing.
    """
    try:
        work()
    except Exception as exc:  # noqa: BLE001 - every failure of a job ends in its failed state
        if not isinstance(exc, (GantryError, OSError)):
            log.exception("%s failed unexpectedly", what)
        status = exc.status if isinstance(exc, JobFailed) else None
        details = exc.details if isinstance(exc, JobFailed) else {}
        fail(reason_for(what, exc), status=status, details=details)
