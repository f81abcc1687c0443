"""GPU hosts: the heartbeat that registers them and reports their GPUs, the
sweep that notices one went quiet, a cordon, and notes on a host's timeline."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from common.errors import NotFound, PermissionDenied
from core import events
from core.permissions import can_admin
from hosts.models import Cordon, Gpu, GpuHost


@dataclass(frozen=True)
class GpuReport:
    index: int
    uuid: str
    name: str
    compute_capability: str
    memory_total_bytes: int
    memory_used_bytes: int = 0
    utilization_percent: int = 0
    power_watts: float = 0.0


def host_heartbeat(
    *,
    name: str,
    address: str = "",
    driver_version: str = "",
    cuda_version: str = "",
    nvml_error: str = "",
    agent_version: str = "",
    gpus: list[GpuReport],
    builders: dict[str, Any] | None = None,
) -> GpuHost:
    """Record a host agent's beat, its GPU inventory and what it can build with;
    register the host on first beat."""
    now = timezone.now()
    with transaction.atomic():
        host, created = GpuHost.objects.select_for_update().get_or_create(
            name=name, defaults={"address": address or "127.0.0.1"}
        )
        came_back = host.offline_since is not None
        host.address = address or host.address
        host.driver_version = driver_version
        host.cuda_version = cuda_version
        host.nvml_error = nvml_error[:255]
        host.agent_version = agent_version
        if builders is not None:
            host.builders = builders
        host.last_heartbeat = now
        host.offline_since = None
        host.save()
        seen = set()
        for gpu in gpus:
            seen.add(gpu.index)
            # A GPU swapped into the same slot keeps the slot's row but gets the new uuid.
            Gpu.objects.filter(uuid=gpu.uuid).exclude(host=host, index=gpu.index).delete()
            Gpu.objects.update_or_create(
                host=host,
                index=gpu.index,
                defaults={
                    "uuid": gpu.uuid,
                    "name": gpu.name,
                    "compute_capability": gpu.compute_capability,
                    "memory_total_bytes": gpu.memory_total_bytes,
                    "memory_used_bytes": gpu.memory_used_bytes,
                    "utilization_percent": gpu.utilization_percent,
                },
            )
        host.gpus.exclude(index__in=seen).delete()
        beat = {
            "type": "gpus",
            "host": host.name,
            "at": host.last_heartbeat.isoformat(),
            "gpus": [
                {"index": g.index, "memory_used_bytes": g.memory_used_bytes, "memory_total_bytes": g.memory_total_bytes,
                 "utilization_percent": g.utilization_percent}
                for g in gpus
            ],
        }  # fmt: skip
        transaction.on_commit(lambda: events.publish(events.DASHBOARD_GROUP, beat))
        if came_back:
            _tell_deployments(host, online=True)
        if created or came_back:
            events.record(
                kind="host.registered" if created else "host.online",
                source=f"worker:{name}",
                host=host,
                message=f"{name} {'registered' if created else 'back online'} with {len(gpus)} GPU(s)",
                data={"gpus": [g.name for g in gpus], "driver": driver_version, "cuda": cuda_version},
            )
    return host


def hosts_sweep() -> list[str]:
    """Mark hosts that missed GANTRY_HOST_OFFLINE_AFTER_BEATS beats offline, once each.

    Nothing is torn down for that: their replicas' status is simply no longer
    known, and the host's next beat brings it back. Only after
    GANTRY_HOST_LOST_GRACE_S are its replicas lost and replaced elsewhere
    (deployments.services.replicas.replace_lost).
    """
    allowed = settings.GANTRY_HEARTBEAT_INTERVAL * settings.GANTRY_HOST_OFFLINE_AFTER_BEATS
    threshold = timezone.now() - timedelta(seconds=allowed)
    marked = []
    for host in GpuHost.objects.filter(last_heartbeat__lt=threshold, offline_since=None):
        with transaction.atomic():
            # Compare-and-swap: a beat or another sweep may have got here first.
            changed = GpuHost.objects.filter(pk=host.pk, offline_since=None, last_heartbeat=host.last_heartbeat).update(
                offline_since=timezone.now()
            )
            if not changed:
                continue
            _tell_deployments(host, online=False)
            events.record(
                kind="host.offline",
                source="system",
                host=host,
                message=f"{host.name} missed {settings.GANTRY_HOST_OFFLINE_AFTER_BEATS} heartbeats "
                f"(last at {host.last_heartbeat:%H:%M:%S}); its replicas' state is unknown, and they are replaced "
                f"elsewhere if it stays away {settings.GANTRY_HOST_LOST_GRACE_S}s",
            )
            marked.append(host.name)
    return marked


def _tell_deployments(host: GpuHost, *, online: bool) -> None:
    """Once committed, tell the pages of the host's deployments that what they show
    changed meaning (a deployment on an offline host shows "unknown")."""
    ids = sorted(set(host.replicas.values_list("deployment_id", flat=True)))

    def send() -> None:
        for deployment_id in ids:
            events.publish(
                events.deployment_group(deployment_id),
                {"type": "host", "deployment": deployment_id, "host": host.name, "online": online},
            )

    transaction.on_commit(send)


def host_broker_seen(*, name: str, run_id: str) -> str:
    """Remember the broker run ``name``'s agent sees now; returns the one it saw before."""
    host = GpuHost.objects.filter(name=name).only("broker_run_id").first()
    if host is None:
        return ""
    if host.broker_run_id != run_id:
        GpuHost.objects.filter(pk=host.pk).update(broker_run_id=run_id)
    return host.broker_run_id


def record_host_event(*, host_name: str, kind: str, source: str, message: str) -> None:
    """Note something about a host on its timeline."""
    with transaction.atomic():
        host = GpuHost.objects.get(name=host_name)
        events.record(kind=kind, source=source, host=host, message=message)


CORDON_REQUIRED = "cordoning and draining GPU hosts needs the admin role"


def host_cordon(*, host_name: str, user: Any, cordoned: bool = True, reason: str = "") -> GpuHost:
    """Mark a host unschedulable (``cordoned``) or schedulable again (admins):
    no replica is placed on a cordoned host; those it runs stay, until drained.
    Saying what it already is changes nothing."""
    if user is not None and not can_admin(user):
        raise PermissionDenied(CORDON_REQUIRED)
    with transaction.atomic():
        host = GpuHost.objects.select_for_update().filter(name=host_name).first()
        if host is None:
            raise NotFound(f"no GPU host named {host_name!r}")
        if cordoned == host.is_cordoned:
            return host
        if cordoned:
            Cordon.objects.create(host=host, created_by=events.signed_in(user), reason=reason)
            message = "cordoned: no replica is placed here; those it runs stay until drained" + (
                f" ({reason})" if reason else ""
            )
        else:
            Cordon.objects.filter(host=host).delete()
            message = "uncordoned: replicas may be placed here again"
        events.record(kind="host.cordon", source=events.source_of(user), actor=user, host=host, message=message)
    return host
