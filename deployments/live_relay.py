"""Joined hosts' live messages, checked at the source before a browser sees them.

A joined host's Redis user reaches no channel-layer key (hosts.grants):
its workers append each live message to the host's own stream
(``queues.live_stream``). This relay, a thread of the control plane's beat
worker, reads every joined host's stream and passes on only what the host may
say: about its own host row, the deployments it serves and the builds it runs.
An event is passed on as the database has it (the row a host may only append
about its own work), not as the host described it. Anything else is dropped,
counted and logged with the host's name.

Without the beat worker, joined hosts' pages are not live: the database (what
a page re-reads) stays the truth.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import redis
from celery.signals import worker_ready
from django.conf import settings
from django.db import close_old_connections

from common import metrics
from core import events, queues
from core.models import Event
from deployments.models import EngineBuild, Replica
from hosts.models import GpuHost, HostCredential

log = logging.getLogger(__name__)

BLOCK_MS = 1000
BATCH = 500
# The queue the beat worker consumes: the relay runs in that worker only.
CONTROL_QUEUE = "control"


def own_work(host_name: str) -> tuple[set[int], set[int]] | None:
    """The deployments ``host_name`` serves and the builds it runs (None: no such host)."""
    host = GpuHost.objects.filter(name=host_name).values_list("pk", flat=True).first()
    if host is None:
        return None
    served = set(Replica.objects.filter(host_id=host).values_list("deployment_id", flat=True))
    return served, set(EngineBuild.objects.filter(host_id=host).values_list("pk", flat=True))


def allowed_groups(
    host_name: str, groups: list[str], payload: dict[str, Any], own: tuple[set[int], set[int]] | None
) -> list[str]:
    """The groups of ``groups`` that ``host_name`` (its ``own_work``) may send
    ``payload`` to: none if the payload names a deployment, build or host that is not its own."""
    if own is None:
        return []
    served, builds = own
    deployment, build = payload.get("deployment"), payload.get("build")
    if (deployment is not None and deployment not in served) or (build is not None and build not in builds):
        return []
    if payload.get("host") not in (None, host_name):
        return []
    mine = {events.DASHBOARD_GROUP, events.host_group(host_name)}
    mine |= {events.deployment_group(d) for d in served} | {events.build_group(b) for b in builds}
    return [group for group in groups if group in mine]


def checked(
    host_name: str, message: dict[str, Any], own: tuple[set[int], set[int]] | None
) -> tuple[list[str], dict[str, Any]]:
    """What to relay of one message from ``host_name``: its groups and payload
    (an event: as its row says), or no groups."""
    groups, payload = message.get("groups"), message.get("payload")
    if not isinstance(groups, list) or not isinstance(payload, dict) or not all(isinstance(g, str) for g in groups):
        return [], {}
    if payload.get("type") == "event":
        row = Event.objects.filter(pk=payload.get("id")).values(*events.EVENT_COLUMNS).first()
        if row is None:
            return [], {}
        payload = dict(events.payload_of_row(row))
    return allowed_groups(host_name, groups, payload, own), payload


def relay_once(client: redis.Redis, positions: dict[str, str]) -> int:
    """Read what joined hosts appended since ``positions`` (stream -> last id read,
    updated) and publish what passes the check. Returns how many were relayed."""
    hosts = HostCredential.objects.filter(revoked_at=None).values_list("host__name", flat=True)
    streams = {queues.live_stream(name): name for name in hosts}
    for stream in streams:
        if stream not in positions:  # a host seen for the first time: from what it appends next
            last = client.xrevrange(stream, count=1)
            positions[stream] = last[0][0].decode() if last else "0-0"
    for stream in list(positions):
        if stream not in streams:
            del positions[stream]
    if not streams:
        time.sleep(BLOCK_MS / 1000)
        return 0
    relayed = 0
    read = client.xread({s: positions[s] for s in streams}, count=BATCH, block=BLOCK_MS) or []
    for stream, entries in read:
        stream = stream.decode()
        host_name = streams[stream]
        own = own_work(host_name)  # once per host and pass, not per message
        for entry_id, fields in entries:
            positions[stream] = entry_id.decode()
            try:
                message = json.loads(fields.get(b"m", b"{}"))
            except ValueError:
                message = {}
            groups, payload = checked(host_name, message if isinstance(message, dict) else {}, own)
            asked = message.get("groups") if isinstance(message, dict) else None
            if not groups or (isinstance(asked, list) and len(groups) < len(asked)):
                metrics.count(metrics.LIVE_MESSAGES_REFUSED, host_name)
                log.warning("host %s sent a live message for %s that is not its own: dropped the groups %s",
                            host_name, asked, sorted(set(asked or []) - set(groups)))  # fmt: skip
            if groups:
                events.publish(groups, payload)
                relayed += 1
    return relayed


def run_forever(stop: threading.Event) -> None:
    client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=3, socket_timeout=BLOCK_MS / 1000 + 5)
    positions: dict[str, str] = {}
    while not stop.is_set():
        try:
            close_old_connections()
            relay_once(client, positions)
        except Exception:  # noqa: BLE001 - Redis or PostgreSQL away: try again, pages re-read on reconnect
            log.warning("the live relay could not read the hosts' streams; trying again", exc_info=True)
            time.sleep(1)


def start() -> threading.Event:
    """Run the relay in a daemon thread of this process; set the returned event to stop it."""
    stop = threading.Event()
    threading.Thread(target=run_forever, args=(stop,), name="gantry-live-relay", daemon=True).start()
    return stop


@worker_ready.connect
def _start_in_the_beat_worker(sender: Any = None, **_: Any) -> None:
    consumed = getattr(getattr(sender, "app", None), "amqp", None)
    if consumed is not None and CONTROL_QUEUE in consumed.queues.consume_from:
        start()
