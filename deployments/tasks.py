"""Control-plane periodic tasks, run by the beat worker on queue "control"."""

from __future__ import annotations

from celery import shared_task

from deployments import services


@shared_task(name="deployments.tasks.sweep_hosts")
def sweep_hosts() -> list[str]:
    return services.hosts_sweep()
