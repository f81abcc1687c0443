"""Reads: the querysets pages, the API and consumers share."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import Prefetch, QuerySet
from django.utils import timezone

from deployments.errors import NotFound
from deployments.models import (
    Backend,
    BuildLogLine,
    Deployment,
    DeploymentModel,
    EngineBuild,
    Event,
    GpuHost,
    LogLine,
    MetricSample,
    RegisteredModel,
)
from deployments.placement import kv_bytes_per_token, placement_gpus, weights_bytes_per_gpu


def host_list() -> QuerySet[GpuHost]:
    return GpuHost.objects.prefetch_related("gpus")


def model_list() -> QuerySet[RegisteredModel]:
    return RegisteredModel.objects.select_related("created_by", "host")


def build_list(
    *, model: str | None = None, status: str | None = None, host: str | None = None
) -> QuerySet[EngineBuild]:
    found = EngineBuild.objects.select_related("model", "host", "created_by")
    if model:
        found = found.filter(model__name=model)
    if status:
        found = found.filter(status=status)
    if host:
        found = found.filter(host__name=host)
    return found


def build_get(build_id: int) -> EngineBuild:
    """One build with its model and host, or NotFound."""
    build = EngineBuild.objects.select_related("model", "host").filter(pk=build_id).first()
    if build is None:
        raise NotFound(f"build {build_id} does not exist")
    return build


def build_log(build_id: int, *, lines: int) -> list[str]:
    newest = BuildLogLine.objects.filter(build_id=build_id).order_by("-id").values_list("line", flat=True)[:lines]
    return list(reversed(newest))


def build_events(build_id: int, *, limit: int = 500) -> list[Event]:
    recent = Event.objects.filter(build_id=build_id).select_related("host").order_by("-created_at", "-id")
    return list(reversed(recent[:limit]))


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


def deployment_plan(deployment: Deployment) -> list[dict]:
    """Per GPU of the host: the models placed on it, their memory fractions and
    bytes, and whether together they stay within the headroom limit."""
    gpus = {gpu.index: gpu for gpu in deployment.host.gpus.all()}
    plan = {
        index: {"gpu": index, "name": gpu.name, "uuid": gpu.uuid, "memory_total_bytes": gpu.memory_total_bytes,
                "models": [], "fraction": 0.0}
        for index, gpu in gpus.items()
    }  # fmt: skip
    for placement in deployment.placements.all():
        for index in placement_gpus(placement, gpus):
            if index in plan:
                entry = plan[index]
                row = {
                    "triton_name": placement.triton_name,
                    "fraction": placement.gpu_memory_fraction,
                    "bytes": int(placement.gpu_memory_fraction * entry["memory_total_bytes"]),
                }
                if placement.backend in (Backend.TENSORRTLLM, Backend.LLM_API):
                    # From the engine files' (or checkpoint's) real sizes and the checkpoint's shape.
                    model, build, tp = placement.registered_model, placement.engine_build, len(placement.gpu_ids)
                    row["engine_bytes"] = weights_bytes_per_gpu(model, build, tp_size=tp)
                    row["kv_cache_tokens"] = placement.kv_cache_tokens
                    per_token = kv_bytes_per_token(model, build, tp_size=tp)
                    row["kv_cache_bytes"] = (placement.kv_cache_tokens or 0) * per_token
                entry["models"].append(row)
                entry["fraction"] = round(entry["fraction"] + placement.gpu_memory_fraction, 6)
    headroom = settings.GANTRY_GPU_MEMORY_HEADROOM
    return [
        {**entry, "headroom": headroom, "within_headroom": entry["fraction"] <= headroom + 1e-9}
        for entry in plan.values()
        if entry["models"]
    ]
