"""Reads: the querysets pages, the API and consumers share."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db.models import Exists, OuterRef, Prefetch, Q, QuerySet

from common.errors import NotFound
from deployments import events
from deployments.gpu_plan import Holder, host_plan, placement_gpus, share_of
from deployments.models import (
    Deployment,
    DeploymentModel,
    DeploymentStatus,
    DesiredState,
    EngineBuild,
    Event,
    GpuHost,
    RegisteredModel,
)


def host_list() -> QuerySet[GpuHost]:
    return GpuHost.objects.prefetch_related("gpus")


def model_list() -> QuerySet[RegisteredModel]:
    return RegisteredModel.objects.select_related("created_by", "host")


_BUILD_COLUMNS = [f.name for f in EngineBuild._meta.concrete_fields]


def build_list(**filters: str) -> QuerySet[EngineBuild]:
    """Builds with what their list shows, in a fixed number of queries whatever their number."""
    # Only the columns shown of the related rows: a model row is wide (its chat
    # template, tokenizer files), and building it cost more than the query.
    rows = EngineBuild.objects.select_related("model", "host", "created_by").only(
        *_BUILD_COLUMNS, "model__name", "model__path", "model__fingerprint", "host__name", "created_by__username"
    )
    return build_filter(rows, **filters)


def build_rows(columns: list[str]) -> QuerySet[EngineBuild]:
    """Builds as the API lists them: ``columns`` as values (lookups such as
    ``model__name`` join), no model instances: on a 50-row page building them
    cost more than the query. ``deployed`` says whether any deployment places
    the build (see builds_deployed_in)."""
    return _resolved_build_rows(tuple(columns)).all()


# Turning 30 names into columns and joins cost 0.34 ms a request, more than
# compiling the SQL (docs/performance.md): each process does it once, and every
# request filters a clone. The cached querysets are never evaluated themselves.
@functools.cache
def _resolved_build_rows(columns: tuple[str, ...]) -> QuerySet[EngineBuild]:
    placed = DeploymentModel.objects.filter(engine_build=OuterRef("pk"))
    return EngineBuild.objects.values(*columns, deployed=Exists(placed))


def builds_deployed_in(build_ids: list[int]) -> dict[int, list[dict[str, Any]]]:
    """Where each of ``build_ids`` is deployed, in one query (cheaper than a prefetch:
    a list page needs three values per placement, not two model rows), or none
    when no id is given: a page passes only its rows that build_rows found
    deployed, and most builds are not."""
    found: dict[int, list[dict[str, Any]]] = {build_id: [] for build_id in build_ids}
    if not build_ids:
        return found
    placements = DeploymentModel.objects.filter(engine_build_id__in=build_ids).order_by("deployment__name")
    for build_id, deployment_id, name, triton_name in placements.values_list(
        "engine_build_id", "deployment_id", "deployment__name", "triton_name"
    ):
        found[build_id].append({"deployment": deployment_id, "name": name, "triton_name": triton_name})
    return found


def build_filter(
    rows: QuerySet[EngineBuild],
    *,
    model: str | None = None,
    status: str | None = None,
    host: str | None = None,
    cache_key: str | None = None,
) -> QuerySet[EngineBuild]:
    if model:
        rows = rows.filter(model__name=model)
    if status:
        rows = rows.filter(status=status)
    if host:
        rows = rows.filter(host__name=host)
    if cache_key:
        rows = rows.filter(cache_key=cache_key)
    return rows


def build_get(build_id: int) -> EngineBuild:
    """One build with its model and host, or NotFound."""
    build = EngineBuild.objects.select_related("model", "host").filter(pk=build_id).first()
    if build is None:
        raise NotFound(f"build {build_id} does not exist")
    return build


def event_list() -> QuerySet[Event]:
    return Event.objects.select_related("host")


def event_rows() -> QuerySet[Event]:
    """Events as the API lists them: the payload's columns as values (events.EVENT_COLUMNS);
    a host row is wide, and model instances cost more than the query."""
    return _resolved_event_rows().all()


@functools.cache  # as _resolved_build_rows
def _resolved_event_rows() -> QuerySet[Event]:
    return Event.objects.values(*events.EVENT_COLUMNS)


def event_filter(
    rows: QuerySet[Event],
    *,
    after: int | None = None,
    kind: str | None = None,
    deployment: int | None = None,
    build: int | None = None,
    model: int | None = None,
    host: str | None = None,
    actor: str | None = None,
    since: datetime | None = None,
) -> QuerySet[Event]:
    """Events matching every given filter; a ``kind`` ending in '.' is a prefix (``deployment.``)."""
    if after is not None:
        rows = rows.filter(id__gt=after)
    if kind:
        rows = rows.filter(kind__startswith=kind) if kind.endswith(".") else rows.filter(kind=kind)
    for field, value in (("deployment_id", deployment), ("build_id", build), ("model_id", model)):
        if value is not None:
            rows = rows.filter(**{field: value})
    if host:
        rows = rows.filter(host__name=host)
    if actor:
        rows = rows.filter(actor__username=actor)
    if since is not None:
        rows = rows.filter(created_at__gte=since)
    return rows


def deployment_list() -> QuerySet[Deployment]:
    placements = DeploymentModel.objects.select_related("registered_model", "engine_build")
    return Deployment.objects.select_related("host", "created_by").prefetch_related(
        Prefetch("placements", queryset=placements)
    )


def deployment_plan(deployment: Deployment) -> list[dict]:
    """Per GPU of the host that the deployment uses: every model placed there, its
    own and those of the other deployments that run (or should) on the host,
    with their memory shares, what the shares hold, and what is wrong (over the
    headroom, or no room left for the processes' CUDA contexts)."""
    holders = [Holder(key=deployment.pk, name=deployment.name, placements=list(deployment.placements.all()),
                      status=deployment.status), *plan_holders(deployment.host, besides=deployment.pk)]  # fmt: skip
    own_gpus = {index for p in deployment.placements.all() for index in placement_gpus(p, _indexes(deployment.host))}
    return [plan.as_dict(own=deployment.pk) for plan in host_plan(deployment.host, holders) if plan.index in own_gpus]


# Deployments whose placements count on their host's GPUs: running, or wanted
# running (a crash-looping one still holds its share), or passing through.
_HOLDING = frozenset(
    {
        DeploymentStatus.LAUNCHING,
        DeploymentStatus.LOADING,
        DeploymentStatus.READY,
        DeploymentStatus.UPDATING,
        DeploymentStatus.DEGRADED,
        DeploymentStatus.STOPPING,
    }
)


def plan_holders(host: GpuHost, *, besides: int | None = None) -> list[Holder]:
    """The other deployments whose memory a host's GPU plan counts."""
    rows = (
        deployment_list()
        .filter(host=host)
        .filter(Q(desired_state=DesiredState.RUNNING) | Q(status__in=_HOLDING))
        .exclude(pk=besides)
        .order_by("name")
    )
    return [Holder(key=d.pk, name=d.name, placements=list(d.placements.all()), status=d.status) for d in rows]


def _indexes(host: GpuHost) -> list[int]:
    return [gpu.index for gpu in host.gpus.all()]


def gpu_shares(hosts: Iterable[GpuHost], deployments: Iterable[Deployment]) -> dict[tuple[int, int], list[dict]]:
    """Per (host id, GPU index): the memory each model of a deployment meant to
    run there is given (its fraction times its instances), for the dashboard's memory bars."""
    indexes = {host.pk: [gpu.index for gpu in host.gpus.all()] for host in hosts}
    shares: dict[tuple[int, int], list[dict]] = {}
    for deployment in deployments:
        if deployment.desired_state != DesiredState.RUNNING:
            continue
        for placement in deployment.placements.all():
            for index in placement_gpus(placement, indexes.get(deployment.host_id, [])):
                shares.setdefault((deployment.host_id, index), []).append(
                    {
                        "deployment": deployment.name,
                        "deployment_id": deployment.pk,
                        "model": placement.triton_name,
                        "fraction": share_of(placement),
                    }
                )
    return shares
