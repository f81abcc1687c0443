"""The event timeline and its live delivery.

``record`` appends an Event row inside the caller's transaction and, once that
transaction commits, publishes it to the object's channel group and the
dashboard group.

Every published message carries ``group`` and ``seq``, a per-group sequence
number kept in Redis: a browser that sees a number missing (a message the
channel layer dropped, which it does silently when a socket falls behind) or
that reconnects re-reads current state over REST. So a lost message costs
freshness for a moment, never correctness, and is never lost unnoticed.

Publishing is one queue put for the caller: each process has one publisher
thread with one event loop and one Redis connection, which numbers and sends
messages in the order they were published (no new loop or connection per
message, and a caller never waits on a slow or down Redis).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from typing import Any, Literal, TypedDict

import redis.asyncio
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models, transaction

from common import metrics
from core import queues
from core.models import Event

log = logging.getLogger(__name__)

DASHBOARD_GROUP = "dashboard"


class EventPayload(TypedDict):
    type: Literal["event"]
    id: int
    at: str
    kind: str
    source: str
    message: str
    deployment: int | None
    build: int | None
    host: str | None
    from_status: str
    to_status: str
    data: dict[str, Any]


def deployment_group(deployment_id: int) -> str:
    return f"deployment.{deployment_id}"


def build_group(build_id: int) -> str:
    return f"build.{build_id}"


def host_group(host_name: str) -> str:
    return f"host.{host_name}"


# Messages a publisher holds while Redis is slow or down; beyond this the oldest
# are dropped (and counted): their sequence numbers are never taken, so the
# browser's re-read on reconnect is what repairs them.
PUBLISH_BACKLOG = 10_000
SEQ_KEY_TTL_S = 7 * 24 * 3600
# Messages a joined host's live stream keeps for the relay (deployments.live_relay).
LIVE_STREAM_LENGTH = 10_000


def seq_key(group: str) -> str:
    return f"gantry:seq:{group}"


async def current_seq(client: redis.asyncio.Redis, group: str) -> int:
    """The number of the last message published to ``group`` (0: none since Redis started)."""
    return int(await client.get(seq_key(group)) or 0)


class Publisher:
    """One per process (see the module docstring)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.dropped = 0
        self.loop = asyncio.new_event_loop()
        self.queue: asyncio.Queue[tuple[list[str], dict[str, Any]]] = asyncio.Queue(maxsize=PUBLISH_BACKLOG)
        self.started = threading.Event()
        threading.Thread(target=self._run, name="gantry-publisher", daemon=True).start()
        self.started.wait(5)

    def submit(self, groups: list[str], payload: dict[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self._enqueue, groups, payload)

    def flush(self, timeout_s: float = 5) -> None:
        """Wait until what was submitted before this call has been sent (or dropped)."""
        asyncio.run_coroutine_threadsafe(self.queue.join(), self.loop).result(timeout_s)

    def _enqueue(self, groups: list[str], payload: dict[str, Any]) -> None:
        if self.queue.full():
            self.queue.get_nowait()
            self.queue.task_done()
            self.dropped += 1
            if self.dropped % 1000 == 1:
                log.warning("over %s live messages wait for Redis: %s dropped so far", PUBLISH_BACKLOG, self.dropped)
        self.queue.put_nowait((groups, payload))

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.create_task(self._send_forever())
        self.loop.call_soon(self.started.set)
        self.loop.run_forever()

    async def _send_forever(self) -> None:
        layer = get_channel_layer()
        # No retries: a message that cannot be numbered now is not sent, and the
        # browsers, whose sockets drop with the same Redis, re-read on reconnect.
        client = redis.asyncio.Redis.from_url(
            settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=2, retry=None
        )
        failing_since: float | None = None
        while True:
            groups, payload = await self.queue.get()
            try:
                await self._send(client, layer, groups, payload)
            except Exception:  # noqa: BLE001 - delivery is best effort; the database holds the truth
                metrics.count(metrics.LIVE_MESSAGES_LOST, "publisher")
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("could not publish to %s; dropping live messages until Redis answers", groups)
                continue
            finally:
                self.queue.task_done()
            if failing_since is not None:
                log.warning("publishing again after %.0fs", time.monotonic() - failing_since)
                failing_since = None

    @staticmethod
    async def _send(client: redis.asyncio.Redis, layer: Any, groups: list[str], payload: dict[str, Any]) -> None:
        """Number ``payload`` in each group's sequence, then hand it to the channel layer
        (a joined host: append it to its live stream, for the control plane to check and relay)."""
        if settings.GANTRY_JOINED_HOST:
            message = json.dumps({"groups": groups, "payload": payload}, cls=DjangoJSONEncoder)
            stream = queues.live_stream(settings.GANTRY_HOST_NAME)
            await client.xadd(stream, {"m": message}, maxlen=LIVE_STREAM_LENGTH, approximate=True)
            return
        async with client.pipeline(transaction=False) as pipe:
            for group in groups:
                pipe.incr(seq_key(group))
                pipe.expire(seq_key(group), SEQ_KEY_TTL_S)
            numbers = (await pipe.execute())[::2]
        await asyncio.gather(
            *(
                layer.group_send(group, {"type": "gantry.message", "payload": {**payload, "group": group, "seq": seq}})
                for group, seq in zip(groups, numbers, strict=True)
            )
        )


_publisher: Publisher | None = None
_publisher_lock = threading.Lock()


def publisher() -> Publisher:
    """This process's publisher (a forked child starts its own: threads do not survive a fork)."""
    global _publisher
    with _publisher_lock:
        if _publisher is None or _publisher.pid != os.getpid():
            _publisher = Publisher()
        return _publisher


def publish(groups: str | list[str], payload: dict[str, Any]) -> None:
    """Send one payload to every socket in ``groups`` (each numbered in its
    group); returns at once and never raises."""
    if get_channel_layer() is None:
        return
    publisher().submit([groups] if isinstance(groups, str) else list(groups), payload)


# The columns an event's payload is written from: a list reads just these with
# values() (no model instances, no host row), as payload_of_row takes them.
EVENT_COLUMNS = ("id", "created_at", "kind", "source", "message", "deployment_id", "build_id", "host__name",
                 "from_status", "to_status", "data")  # fmt: skip


def payload_of_row(row: dict[str, Any]) -> EventPayload:
    """An event's payload from its EVENT_COLUMNS."""
    return {
        "type": "event",
        "id": row["id"],
        "at": row["created_at"].isoformat(),
        "kind": row["kind"],
        "source": row["source"],
        "message": row["message"],
        "deployment": row["deployment_id"],
        "build": row["build_id"],
        "host": row["host__name"],
        "from_status": row["from_status"],
        "to_status": row["to_status"],
        "data": row["data"],
    }


def event_payload(event: Event) -> EventPayload:
    row = {name: getattr(event, name) for name in EVENT_COLUMNS if name != "host__name"}
    return payload_of_row({**row, "host__name": event.host.name if event.host_id else None})


def record(
    *,
    kind: str,
    source: str,
    message: str = "",
    actor: Any = None,
    deployment: models.Model | None = None,
    host: models.Model | None = None,
    from_status: str = "",
    to_status: str = "",
    data: dict[str, Any] | None = None,
    **objects: Any,
) -> Event:
    """Append an event and publish it after the surrounding transaction commits.

    ``deployment`` is a Deployment, ``host`` a GpuHost, and ``objects`` may name
    a ``build`` (an EngineBuild) or a ``model`` (a RegisteredModel): core knows
    them only as rows."""
    event = Event.objects.create(
        kind=kind,
        source=source,
        message=message,
        actor=signed_in(actor),
        deployment=deployment,
        host=host,
        from_status=from_status,
        to_status=to_status,
        data=data or {},
        **objects,
    )
    payload = event_payload(event)
    groups = [DASHBOARD_GROUP]
    if deployment is not None:
        groups.append(deployment_group(deployment.pk))
    if host is not None:
        groups.append(host_group(host.name))
    if objects.get("build") is not None:
        groups.append(build_group(objects["build"].pk))

    transaction.on_commit(lambda: publish(groups, dict(payload)))
    return event


def signed_in(user: Any) -> Any:
    """``user`` if it is a signed-in user (to record as an actor or creator), else None."""
    return user if getattr(user, "is_authenticated", False) else None


def source_of(user: Any) -> str:
    if signed_in(user) is not None:
        return f"user:{user.get_username()}"
    return "system"
