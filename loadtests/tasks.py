"""The control plane's periodic work for load tests (beat, queue "control")."""

from __future__ import annotations

from celery import shared_task

from loadtests import runs, services, tuning_services


@shared_task(name="loadtests.tasks.reap_runs")
def reap_runs() -> int:
    """Fail load tests and tuning runs whose worker stopped reporting, and put
    back the starting settings that ended tuning runs could not."""
    return services.runs_reap() + tuning_services.tunings_reap() + tuning_services.tunings_restore_pending()


@shared_task(name="loadtests.tasks.revoke_ended_run_keys")
def revoke_ended_run_keys() -> int:
    """Revoke the gateway keys of load tests and tuning runs that have ended."""
    return runs.ended_keys_revoke()
