"""Celery tasks run by the worker on each GPU host. Thin: they take ids and
call one function; the database row decides whether there is work to do, and
the one job runner (workers.jobs) turns a failure into the row's failed state."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from core import queues
from hosts.services import hosts
from workers import (
    agent,  # noqa: F401 - importing agent connects it to worker start
    cache,
    downloads,
)
from workers.deploy import lifecycle
from workers.engines import run
from workers.inspection import inspect
from workers.jobs import run_job, source
from workers.loadtest import runs as loadtest_runs
from workers.loadtest import tuning as loadtest_tuning


@shared_task(name=queues.LAUNCH_REPLICA)
def launch_replica(replica_id: int) -> None:
    lifecycle.launch(replica_id)


@shared_task(name=queues.STOP_REPLICA)
def stop_replica(replica_id: int) -> None:
    lifecycle.stop(replica_id)


# The names these had in 0.1.0 (they take a replica, not a deployment), kept for
# the messages an older control plane queued before the upgrade; drop them in the
# release after next.
shared_task(name="workers.tasks.launch_deployment")(launch_replica.run)
shared_task(name="workers.tasks.stop_deployment")(stop_replica.run)


@shared_task(name=queues.FORGET_DEPLOYMENT)
def forget_deployment(deployment_id: int, name: str, serial: int | None = None) -> None:
    what = f"removing the files of deleted deployment {name}"
    if serial is not None:
        what = f"removing the files of {name}'s removed replica r{serial}"
    run_job(what, lambda: lifecycle.forget(deployment_id, name, serial), fail=_on_host_timeline)


@shared_task(name=queues.FORGET_BUILD)
def forget_build(build_id: int) -> None:
    run_job(f"removing the files of deleted build {build_id}", lambda: run.forget(build_id), fail=_on_host_timeline)


def _on_host_timeline(reason: str, *, status: str | None, details: dict) -> None:
    """A job whose row is gone (a deleted deployment or build) fails on its host's timeline."""
    hosts.record_host_event(
        host_name=settings.GANTRY_HOST_NAME, kind="host.cleanup_failed", source=source(), message=reason
    )


@shared_task(name=queues.APPLY_GENERATION)
def apply_generation(replica_id: int, generation: int) -> None:
    lifecycle.apply_generation(replica_id, generation)


@shared_task(name=queues.INSPECT_MODEL)
def inspect_model(model_id: int) -> None:
    inspect(model_id)


# Tasks that bound themselves (a build's own time limit, a download's cancel, a load test's
# steps, a tuning run's budget) run under this Celery limit, a month, instead of the
# worker's default (CELERY_TASK_SOFT_TIME_LIMIT, minutes). Not None: Celery reads a task's
# None as "the worker's default" (billiard's `soft_timeout or self.soft_timeout`), which
# cut a tuning run at its fifth minute.
_MONTH_S = 30 * 24 * 3600
SELF_BOUNDED = {"soft_time_limit": _MONTH_S, "time_limit": _MONTH_S + 60}


# A build enforces its own time limit (and may run for hours).
@shared_task(name=queues.RUN_BUILD, **SELF_BOUNDED)
def run_build(build_id: int) -> None:
    run.run_build(build_id)


# A download may take hours for a large model; it ends itself on a cancel.
@shared_task(name=queues.RUN_DOWNLOAD, **SELF_BOUNDED)
def run_download(download_id: int) -> None:
    downloads.run_download(download_id)


@shared_task(name=queues.REMOVE_COPY)
def remove_copy(model_id: int) -> None:
    cache.remove_asked(model_id)


# A load test bounds each of its steps itself (loadtests.workload).
@shared_task(name=queues.RUN_LOADTEST, **SELF_BOUNDED)
def run_loadtest(run_id: int, key: str = "") -> None:
    loadtest_runs.run(run_id, key)


# A tuning run bounds itself by its budget (loadtests.tuning).
@shared_task(name=queues.RUN_TUNING, **SELF_BOUNDED)
def run_tuning(run_id: int, key: str = "") -> None:
    loadtest_tuning.run(run_id, key)
