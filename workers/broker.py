"""The broker (Redis) as a host's agent sees it, once a beat.

Each beat the agent sends what waits in the outbox for this host, notices an
outage (and the broker's return), and notices a broker restart: Redis names
each run of itself (``run_id``), and a restart may have lost the tasks that sat
in its queues, so the tasks this host's passing rows wait for (a launch, a
stop, a new generation, a pending build or inspection) are sent again. A duplicate is harmless;
a lost one would strand its row. The last run id seen is kept on the host's
row, so a restart that happened while this worker was down counts too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis
from django.conf import settings

from hosts import outbox
from hosts.services import hosts
from workers.jobs import source

log = logging.getLogger(__name__)


def run_id() -> str | None:
    """The broker's current run id, or None when it cannot be reached."""
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL, socket_connect_timeout=2, socket_timeout=2, retry=None)
    try:
        return str(client.info("server")["run_id"])
    except (redis.RedisError, OSError, KeyError):
        return None
    finally:
        client.close()


@dataclass
class BrokerWatch:
    """What the agent remembers between beats."""

    down_since: float | None = None

    def beat(self) -> None:
        host = settings.GANTRY_HOST_NAME
        current = run_id()
        if current is None:
            if self.down_since is None:
                self.down_since = time.monotonic()
                hosts.record_host_event(
                    host_name=host,
                    kind="host.broker_unreachable",
                    source=source(),
                    message="the broker (Redis) is unreachable: new tasks wait in the outbox; "
                    "servers keep running and reconcile goes on",
                )
            return
        if self.down_since is not None:
            hosts.record_host_event(
                host_name=host,
                kind="host.broker_back",
                source=source(),
                message=f"the broker is reachable again after {time.monotonic() - self.down_since:.0f}s",
            )
            self.down_since = None
        previous = hosts.host_broker_seen(name=host, run_id=current)
        if previous and previous != current:
            redrive_host(
                host_name=host,
                source=source(),
                reason="the broker restarted, and the tasks in its queues may be lost",
            )
        sent = outbox.relay(host_name=host)
        if sent:
            log.info("sent %s task(s) that waited in the outbox", sent)


def redrive_host(*, host_name: str, source: str, reason: str) -> list[str]:
    """Send again the task each passing row on ``host_name`` waits for (every
    registered hosts.outbox.HostTask: launching, stopping and updating
    replicas, pending builds and inspections, queued load tests and tuning
    runs), and say so on the host's timeline. Returns what was sent."""
    sent = outbox.resend_waiting(host_name=host_name, source=source, message=f"{reason}: sending its task again")
    hosts.record_host_event(
        host_name=host_name,
        kind="host.redrive",
        source=source,
        message=f"{reason}; sent again: {', '.join(sent) or 'nothing (no passing row had lost its task)'}",
    )
    return sent
