"""Reads of hosts."""

from __future__ import annotations

from django.db.models import Exists, OuterRef, QuerySet

from hosts.models import Cordon, GpuHost


def host_list() -> QuerySet[GpuHost]:
    """Hosts with their GPUs, and ``cordoned`` (whether one is), in two queries."""
    cordoned = Exists(Cordon.objects.filter(host=OuterRef("pk")))
    return GpuHost.objects.prefetch_related("gpus").annotate(cordoned=cordoned)
