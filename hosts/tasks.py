"""The hosts' periodic task, run by the beat worker on queue "control"."""

from __future__ import annotations

from celery import shared_task

from core import queues
from hosts.services import host_join


@shared_task(name=queues.SYNC_HOST_ACCESS)
def sync_host_access() -> int:
    """Joined hosts' database grants and Redis users match what the database holds."""
    return host_join.host_access_sync()
