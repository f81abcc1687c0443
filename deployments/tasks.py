"""Control-plane periodic tasks, run by the beat worker on queue "control"."""

from __future__ import annotations

from celery import shared_task

from core import queues
from deployments import live_relay  # noqa: F401 - live_relay starts in the beat worker
from deployments.services import autoscale, builds, downloads, replicas
from hosts import outbox
from hosts.services import channel, hosts


@shared_task(name=queues.SWEEP_HOSTS)
def sweep_hosts() -> list[str]:
    """Hosts that missed their beats go offline; replicas on hosts gone for the
    grace period are lost and replaced on hosts with room; deployments with
    autoscaling on are scaled to their load; hosts' certificate requests are
    signed (or refused); builds and downloads whose worker
    went quiet fail; tasks left in the outbox by a broker outage are sent (for
    hosts whose agent is down too, so they are queued for its return)."""
    builds.builds_reap()
    downloads.downloads_reap()
    outbox.relay()
    offline = hosts.hosts_sweep()
    replicas.replace_lost(source="system")
    autoscale.deployments_autoscale()
    channel.channel_requests_sign()
    channel.revocation_list_refresh()
    return offline
