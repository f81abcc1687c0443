"""The event timeline and its live delivery.

``record`` appends an Event row inside the caller's transaction and, once that
transaction commits, publishes it to the object's channel group and the
dashboard group. A browser that reconnects re-reads current state over REST,
so a message lost while Redis is down costs freshness, never correctness.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, TypedDict

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from deployments.models import Deployment, Event, GpuHost

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


def publish(group: str, payload: dict[str, Any]) -> None:
    """Send one payload to every socket in ``group``; never raises.

    The database already holds the truth when this runs, so a broken channel
    layer is logged and otherwise ignored.
    """
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(group, {"type": "gantry.message", "payload": payload})
    except Exception:  # noqa: BLE001 - delivery is best effort by design
        log.warning("could not publish to %s", group, exc_info=True)


def event_payload(event: Event) -> EventPayload:
    return {
        "type": "event",
        "id": event.pk,
        "at": event.created_at.isoformat(),
        "kind": event.kind,
        "source": event.source,
        "message": event.message,
        "deployment": event.deployment_id,
        "build": event.build_id,
        "host": event.host.name if event.host_id else None,
        "from_status": event.from_status,
        "to_status": event.to_status,
        "data": event.data,
    }


def record(
    *,
    kind: str,
    source: str,
    message: str = "",
    actor: Any = None,
    deployment: Deployment | None = None,
    host: GpuHost | None = None,
    from_status: str = "",
    to_status: str = "",
    data: dict[str, Any] | None = None,
    **objects: Any,
) -> Event:
    """Append an event and publish it after the surrounding transaction commits."""
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

    def _send() -> None:
        for group in groups:
            publish(group, dict(payload))

    transaction.on_commit(_send)
    return event


def signed_in(user: Any) -> Any:
    """``user`` if it is a signed-in user (to record as an actor or creator), else None."""
    return user if getattr(user, "is_authenticated", False) else None


def source_of(user: Any) -> str:
    if signed_in(user) is not None:
        return f"user:{user.get_username()}"
    return "system"
