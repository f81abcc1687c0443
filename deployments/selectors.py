"""Reads: the querysets pages, the API and consumers share."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Exists, JSONField, OuterRef, Prefetch, Q, QuerySet, prefetch_related_objects
from django.utils import timezone

from common.errors import NotFound
from core import events
from core.fields import stored_json
from core.models import Event
from deployments.gpu_plan import Holder, host_plan, replica_gpus, share_of
from deployments.models import (
    CheckpointCopy,
    Deployment,
    DeploymentModel,
    DeploymentRevision,
    DeploymentStatus,
    DesiredState,
    EngineBuild,
    ModelDownload,
    RegisteredModel,
    Replica,
)
from deployments.services.placements import placement_from_snapshot, placement_rows
from hosts.models import Gpu, GpuHost


def model_list() -> QuerySet[RegisteredModel]:
    return RegisteredModel.objects.select_related("created_by", "host").prefetch_related(
        Prefetch("copies", CheckpointCopy.objects.select_related("host").order_by("host__name")),
        Prefetch("downloads", ModelDownload.objects.select_related("host")),
    )


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
    cost more than the query. A JSON column comes as its stored text (an
    orjson.Fragment, core.fields.StoredJSON), under build_row_key's key.
    ``deployed`` says whether any deployment places the build (see
    builds_deployed_in)."""
    return _resolved_build_rows(tuple(columns)).all()


_BUILD_JSON = frozenset(f.name for f in EngineBuild._meta.concrete_fields if isinstance(f, JSONField))


def build_row_key(column: str) -> str:
    """The key of ``column`` in a build_rows row."""
    return f"{column}_stored" if column in _BUILD_JSON else column


# Turning 30 names into columns and joins cost 0.34 ms a request, more than
# compiling the SQL (docs/performance.md): each process does it once, and every
# request filters a clone. The cached querysets are never evaluated themselves.
@functools.cache
def _resolved_build_rows(columns: tuple[str, ...]) -> QuerySet[EngineBuild]:
    placed = DeploymentModel.objects.filter(engine_build=OuterRef("pk"))
    stored = {build_row_key(c): stored_json(c) for c in columns if c in _BUILD_JSON}
    plain = [c for c in columns if c not in _BUILD_JSON]
    return EngineBuild.objects.values(*plain, **stored, deployed=Exists(placed))


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


def _shown_with() -> list[Prefetch | str]:
    """What DeploymentOut reads besides the row: its placements, replicas and pinned hosts."""
    placements = DeploymentModel.objects.select_related("registered_model", "engine_build")
    replicas = Replica.objects.select_related("host").order_by("serial")
    return [Prefetch("placements", queryset=placements), Prefetch("replica_set", queryset=replicas), "pinned_hosts"]


def deployment_list() -> QuerySet[Deployment]:
    return Deployment.objects.select_related("created_by").prefetch_related(*_shown_with())


def deployment_shown(deployment: Deployment) -> Deployment:
    """The row a service returned, with what DeploymentOut reads fetched beside
    it: an action's answer is the state the action left, not a second read."""
    prefetch_related_objects([deployment], "created_by", *_shown_with())
    return deployment


def deployment_plan(deployment: Deployment) -> list[dict]:
    """Per replica, per GPU of its host that it uses: every model placed there,
    its own and those of the other replicas that run (or should) on the host,
    with their memory shares, what the shares hold, and what is wrong (over the
    headroom, or no room left for the processes' CUDA contexts). A deployment
    with no replica yet is shown on its first pinned host, its GPUs as numbered."""
    placements = list(deployment.placements.all())
    resting = (DeploymentStatus.STOPPED, DeploymentStatus.LOST)
    live = [r for r in deployment.replica_set.all() if r.status not in resting]
    where = [(r.host, r.serial, r.gpus, r.status, r.pk) for r in live]
    if not where:
        pinned = sorted(deployment.pinned_hosts.all(), key=lambda h: h.name)
        where = [(pinned[0], 0, {}, deployment.status, None)] if pinned else []
    found = []
    for host, serial, gpu_map, status, replica_id in where:
        count = len(_indexes(host))
        own = Holder(key=deployment.pk, name=deployment.name, placements=placements, status=status, replica=serial,
                     gpu_map=gpu_map)  # fmt: skip
        gpus = {index for p in placements for index in replica_gpus(p, gpu_map, count)}
        others = plan_holders(host, besides=deployment.pk if replica_id is None else None, besides_replica=replica_id)
        found += [{**plan.as_dict(own=deployment.pk), "host": host.name, "replica": serial}
                  for plan in host_plan(host, [own, *others]) if plan.index in gpus]  # fmt: skip
    return found


# Replicas whose placements count on their host's GPUs: running, or wanted
# running (a crash-looping one still holds its share), or passing through.
_HOLDING = frozenset(
    {
        DeploymentStatus.LAUNCHING,
        DeploymentStatus.FETCHING,
        DeploymentStatus.LOADING,
        DeploymentStatus.READY,
        DeploymentStatus.UPDATING,
        DeploymentStatus.DEGRADED,
        DeploymentStatus.STOPPING,
        DeploymentStatus.LOST,
    }
)


def plan_holders_by_host(
    hosts: Iterable[GpuHost], *, besides: int | None = None, besides_replica: int | None = None
) -> dict[int, list[Holder]]:
    """Per host id, the replicas whose memory its GPU plan counts (but those of
    deployment ``besides`` and replica ``besides_replica``), in one query."""
    wanted = Q(desired_state=DesiredState.RUNNING, deployment__desired_state=DesiredState.RUNNING)
    placements = DeploymentModel.objects.select_related("registered_model", "engine_build")
    rows = (
        Replica.objects.filter(host__in=list(hosts))
        .filter(wanted | Q(status__in=_HOLDING))
        .exclude(status=DeploymentStatus.STOPPED)
        .exclude(deployment_id=besides)
        .exclude(pk=besides_replica)
        .select_related("deployment")
        .prefetch_related(Prefetch("deployment__placements", queryset=placements))
        .order_by("deployment__name", "serial")
    )
    found: dict[int, list[Holder]] = {}
    generations: dict[tuple[int, int], list[DeploymentModel] | None] = {}
    for r in rows:
        placements = list(r.deployment.placements.all())
        if r.generation != r.deployment.generation:  # mid-roll, or rolled back: it runs its own generation
            placements = _generation_placements(r.deployment, r.generation, generations) or placements
        found.setdefault(r.host_id, []).append(
            Holder(key=r.deployment_id, name=r.deployment.name, placements=placements,
                   status=r.status, replica=r.serial, gpu_map=r.gpus)
        )  # fmt: skip
    return found


def _generation_placements(
    deployment: Deployment, generation: int, known: dict[tuple[int, int], list[DeploymentModel] | None]
) -> list[DeploymentModel] | None:
    """The placements of ``generation`` as its revision recorded them (unsaved
    rows), read once per plan; None when it has no revision or names a model
    since deleted (then the current placements are counted)."""
    key = (deployment.pk, generation)
    if key not in known:
        revision = DeploymentRevision.objects.filter(deployment=deployment, generation=generation).first()
        try:
            resolved = [placement_from_snapshot(item) for item in revision.spec] if revision else None
        except RegisteredModel.DoesNotExist:
            resolved = None
        known[key] = placement_rows(resolved, deployment=deployment) if resolved else None
    return known[key]


def plan_holders(host: GpuHost, *, besides: int | None = None, besides_replica: int | None = None) -> list[Holder]:
    """The replicas whose memory a host's GPU plan counts."""
    return plan_holders_by_host([host], besides=besides, besides_replica=besides_replica).get(host.pk, [])


def _indexes(host: GpuHost) -> list[int]:
    return [gpu.index for gpu in host.gpus.all()]


def replica_ejections(deployment_id: int, *, hours: int = 24) -> dict[int, int]:
    """Per replica serial, how often a gateway process ejected it in the last ``hours``."""
    since = timezone.now() - timedelta(hours=hours)
    rows = Event.objects.filter(
        deployment_id=deployment_id, kind="replica.balancing", created_at__gte=since, message__contains="ejected"
    ).values_list("data", flat=True)
    found: dict[int, int] = {}
    for data in rows:
        serial = (data or {}).get("replica")
        if serial is not None:
            found[serial] = found.get(serial, 0) + 1
    return found


def reference_host_name(deployment: Deployment) -> str:
    """The host a deployment's placements are checked against on its pages: its
    first pinned host, else its first replica's ("" when it has neither)."""
    pinned = sorted(h.name for h in deployment.pinned_hosts.all())
    replicas = [r.host.name for r in deployment.replica_set.all()]
    return (pinned or replicas or [""])[0]


def deployment_search(*, name: str = "", status: str = "", host: str = "") -> QuerySet[Deployment]:
    """Deployments by name (containing ``name``), status and a host carrying one of
    their replicas, in name order: the dashboard pages through these."""
    rows = deployment_list()
    if name:
        rows = rows.filter(name__contains=name)
    if status:
        rows = rows.filter(status=status)
    if host:
        rows = rows.filter(pk__in=Replica.objects.filter(host__name=host).values("deployment_id"))
    return rows.order_by("name")


def fleet_summary() -> dict[str, Any]:
    """Counts of the whole fleet in a few aggregate queries: deployments by
    status, replicas by status, hosts online and GPUs."""
    from django.db.models import Count

    allowed = timezone.now() - timedelta(
        seconds=settings.GANTRY_HEARTBEAT_INTERVAL * settings.GANTRY_HOST_OFFLINE_AFTER_BEATS
    )
    by_status = dict(Deployment.objects.values_list("status").annotate(n=Count("pk")).values_list("status", "n"))
    replicas = dict(Replica.objects.values_list("status").annotate(n=Count("pk")).values_list("status", "n"))
    return {
        "deployments": sum(by_status.values()),
        "deployments_by_status": sorted(by_status.items()),
        "replicas": sum(replicas.values()),
        "replicas_ready": replicas.get(DeploymentStatus.READY, 0),
        "hosts": GpuHost.objects.count(),
        "hosts_online": GpuHost.objects.filter(last_heartbeat__gte=allowed).count(),
        "gpus": Gpu.objects.count(),
    }


@dataclass(frozen=True)
class _PlacedShare:
    """The columns of a placement its share of a GPU is computed from (gpu_plan.share_of, placement_gpus)."""

    triton_name: str
    backend: str
    gpu_memory_fraction: float
    instance_count: int
    instance_kind: str
    gpu_ids: list[int]


def gpu_shares_on(hosts: list[GpuHost]) -> dict[tuple[int, int], list[dict]]:
    """Per (host id, GPU index) of ``hosts``: the memory each model of a replica
    meant to run there is given (its fraction times its instances), for the
    dashboard's memory bars. Two queries of plain values: a page of 20 hosts at
    fleet size carries some 2000 replicas, and model instances cost seconds."""
    counts = {host.pk: len(host.gpus.all()) for host in hosts}
    replicas = list(
        Replica.objects.filter(host__in=hosts, desired_state=DesiredState.RUNNING,
                               deployment__desired_state=DesiredState.RUNNING)
        .exclude(status=DeploymentStatus.STOPPED)
        .values_list("deployment_id", "deployment__name", "serial", "host_id", "gpu_map")
    )  # fmt: skip
    placements: dict[int, list[_PlacedShare]] = {}
    columns = ("triton_name", "backend", "gpu_memory_fraction", "instance_count", "instance_kind", "gpu_ids")
    rows = DeploymentModel.objects.filter(deployment_id__in={r[0] for r in replicas}).order_by("deployment_id", "id")
    for deployment_id, *values in rows.values_list("deployment_id", *columns):
        placements.setdefault(deployment_id, []).append(_PlacedShare(*values))
    shares: dict[tuple[int, int], list[dict]] = {}
    for deployment_id, name, serial, host_id, gpu_map in replicas:
        mapped = {int(logical): index for logical, index in (gpu_map or {}).items()}
        for placement in placements.get(deployment_id, []):
            for index in replica_gpus(placement, mapped, counts.get(host_id, 0)):  # type: ignore[arg-type]
                shares.setdefault((host_id, index), []).append(
                    {"deployment": name, "deployment_id": deployment_id, "replica": serial,
                     "model": placement.triton_name, "fraction": share_of(placement)}  # type: ignore[arg-type]
                )  # fmt: skip
    return shares


def replicas_using(model_id: int, host_name: str) -> list[str]:
    """The replicas on ``host_name`` that run the model or want to, as
    "<deployment>'s <replica>" (a model they use is never removed from that host)."""
    resting = [DeploymentStatus.PENDING, DeploymentStatus.STOPPED, DeploymentStatus.FAILED, DeploymentStatus.LOST]
    replicas = Replica.objects.select_related("deployment").filter(
        Q(desired_state=DesiredState.RUNNING, deployment__desired_state=DesiredState.RUNNING) | ~Q(status__in=resting),
        host__name=host_name,
        deployment__placements__registered_model_id=model_id,
    )
    return sorted({f"{r.deployment.name}'s {r.label}" for r in replicas})
