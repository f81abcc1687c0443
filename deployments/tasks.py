"""Control-plane periodic tasks, run by the beat worker on queue "control"."""

from __future__ import annotations

from celery import shared_task

from deployments import queues
from deployments.services import builds, hosts


@shared_task(name=queues.SWEEP_HOSTS)
def sweep_hosts() -> list[str]:
    """Hosts that missed their beats go offline; builds whose worker went quiet fail."""
    builds.builds_reap()
    return hosts.hosts_sweep()
