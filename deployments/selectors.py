"""Reads: the querysets pages, the API and consumers share."""

from __future__ import annotations

from datetime import timedelta

from django.db.models import Prefetch, QuerySet
from django.utils import timezone

from deployments.models import Deployment, DeploymentModel, Event, GpuHost, LogLine, MetricSample, RegisteredModel


def host_list() -> QuerySet[GpuHost]:
    return GpuHost.objects.prefetch_related("gpus")


def model_list() -> QuerySet[RegisteredModel]:
    return RegisteredModel.objects.select_related("created_by")


def deployment_list() -> QuerySet[Deployment]:
    placements = DeploymentModel.objects.select_related("registered_model", "engine_build")
    return Deployment.objects.select_related("host", "created_by").prefetch_related(
        Prefetch("placements", queryset=placements)
    )


def deployment_events(deployment_id: int, *, limit: int = 200) -> list[Event]:
    recent = Event.objects.filter(deployment_id=deployment_id).select_related("host").order_by("-created_at", "-id")
    return list(reversed(recent[:limit]))


def deployment_metrics(deployment_id: int, *, minutes: int) -> QuerySet[MetricSample]:
    since = timezone.now() - timedelta(minutes=minutes)
    return MetricSample.objects.filter(deployment_id=deployment_id, at__gte=since).order_by("at", "id")


def deployment_log(deployment_id: int, *, lines: int) -> list[str]:
    newest = LogLine.objects.filter(deployment_id=deployment_id).order_by("-id").values_list("line", flat=True)[:lines]
    return list(reversed(newest))
