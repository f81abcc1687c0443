"""Reads of hosts."""

from __future__ import annotations

from django.db.models import QuerySet

from hosts.models import GpuHost


def host_list() -> QuerySet[GpuHost]:
    return GpuHost.objects.prefetch_related("gpus")
