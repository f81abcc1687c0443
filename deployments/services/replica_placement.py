"""Where a deployment's replicas go: the candidate hosts (online, not cordoned,
holding the model's files or able to fetch them from the hub: holding_hosts), their free ports,
and a host and GPUs for each new replica from the hosts' one GPU plan
(gpu_plan.choose_host). Spread puts replicas on different hosts first, pack
onto the fewest; a replica that fits nowhere is refused before anything
starts, with the closest host's shortfall.

The callers (services.replicas, services.deployments) hold the deployment's
row lock; the functions here lock the candidate hosts' rows after it.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

from django.conf import settings
from django.db.models import F, Max

from common.errors import InvalidTransition
from deployments import backends, selectors
from deployments.gpu_plan import Candidate, Choice, Holder, choose_host, host_plan, plan_problems
from deployments.models import (
    CheckpointCopy,
    Deployment,
    DeploymentModel,
    DeploymentStatus,
    DesiredState,
    InstanceKind,
    PlacementPolicy,
    RegisteredModel,
    Replica,
)
from hosts.models import GpuHost

S = DeploymentStatus


def allocate_ports(host: GpuHost) -> tuple[int, int, int]:
    """The lowest free triple of ports in the configured range on ``host``."""
    low, high = settings.GANTRY_TRITON_PORT_RANGE
    used: set[int] = set()
    for row in Replica.objects.filter(host=host).values_list("http_port", "grpc_port", "metrics_port"):
        used.update(row)
    for base in range(low, high - 1, 3):
        triple = (base, base + 1, base + 2)
        if not used.intersection(triple):
            return triple
    raise InvalidTransition(f"no free ports left in GANTRY_TRITON_PORT_RANGE on {host.name}")


def candidate_hosts(pinned: list[GpuHost], *, lock: bool, replacing: bool = False) -> list[GpuHost]:
    """The hosts a deployment's replicas may go to: its pinned hosts that are
    online, else every online host, never a cordoned one; their rows locked
    with ``lock`` (in id order), so two placements are checked one after the other. A person's
    start on pinned hosts that are all offline still places there (the launch
    waits for the host); a replacement for a lost replica never does."""
    rows = GpuHost.objects.filter(pk__in=[h.pk for h in pinned]) if pinned else GpuHost.objects.all()
    if lock:
        list(rows.select_for_update().order_by("pk").values_list("pk", flat=True))
    found = list(rows.filter(cordon__isnull=True).prefetch_related("gpus").order_by("name"))
    online = [host for host in found if host.is_online]
    return online or (found if pinned and not replacing else [])


def cordoned_words(pinned: list[GpuHost]) -> str:
    """The cordoned hosts a placement left out, for its refusal ("" when none)."""
    rows = GpuHost.objects.filter(pk__in=[h.pk for h in pinned]) if pinned else GpuHost.objects.all()
    names = list(rows.filter(cordon__isnull=False).order_by("name").values_list("name", flat=True))
    return f" ({', '.join(names)} cordoned: no replica is placed there)" if names else ""


def gpu_hosts_for_auto(hosts: list[GpuHost], placements: list[DeploymentModel]) -> tuple[list[GpuHost], list[str]]:
    """The candidates for a replica with an "auto" placement: only hosts with
    GPUs while any candidate has one (auto is a GPU where there is one: an LLM
    on a CPU-only host beside GPU hosts would serve an equal share of the
    traffic ~100x slower), every host when none has; and the names left out.
    A placement that asks for KIND_CPU keeps every host."""
    if not any(p.instance_kind == InstanceKind.AUTO for p in placements):
        return hosts, []
    with_gpus = [host for host in hosts if host.gpus.all()]
    if not with_gpus:
        return hosts, []
    return with_gpus, [host.name for host in hosts if host not in with_gpus]


@dataclass(frozen=True)
class Holding:
    """The candidates by what they hold of the files placements read."""

    holders: list[GpuHost]  # every file is there
    fetchers: list[GpuHost]  # only hub models are missing: its worker downloads them before it launches
    lacking: list[str]  # why each other host is left out, for a refusal


def holding_hosts(hosts: list[GpuHost], placements: list[DeploymentModel]) -> Holding:
    """Sort the candidates by the files the placements read: a copy of each
    registered checkpoint that matches its fingerprint (CheckpointCopy, which
    each host's agent records), and an engine build's folder, which is on the
    host that built it. A host that lacks only models it can download first
    (RegisteredModel.fetchable) may take a replica that fetches them."""
    model_ids = {p.registered_model_id for p in placements}
    held = set(
        CheckpointCopy.objects.filter(model_id__in=model_ids, host__in=hosts, fingerprint=F("model__fingerprint"))
        .values_list("host_id", "model_id")
    )  # fmt: skip
    models = {
        m.pk: m for m in RegisteredModel.objects.filter(pk__in=model_ids).only("name", "path", "commit", "inspection")
    }
    builds = {p.engine_build_id: p.engine_build.host_id for p in placements if p.engine_build_id}
    holding = Holding([], [], [])
    for host in hosts:
        missing = [models[m] for m in sorted(model_ids) if (host.pk, m) not in held]
        words = [f"{m.name}'s checkpoint" for m in missing]
        words += [f"build {b}'s engine" for b, built_on in sorted(builds.items()) if built_on != host.pk]
        if not words:
            holding.holders.append(host)
        elif len(words) == len(missing) and all(m.fetchable for m in missing):
            holding.fetchers.append(host)
        else:
            holding.lacking.append(f"{host.name} lacks {' and '.join(words)}")
    return holding


def _refusal_notes(pinned: list[GpuHost], lacking: list[str], left_out: list[str]) -> str:
    """What a refusal adds about the hosts placement left out: cordoned, lacking
    the files, without GPUs for an auto placement."""
    notes = cordoned_words(pinned)
    if lacking:
        notes += (
            f" ({'; '.join(lacking)}: a replica goes only where its files are; copy the folder to the same "
            "path there and its agent finds it within seconds)"
        )
    if left_out:
        notes += (
            f" ({', '.join(left_out)} without GPUs left out: instance_kind auto runs on a GPU where the "
            "hosts have one; ask for KIND_CPU to run there)"
        )
    return notes


def plan_replicas(
    *,
    deployment: Deployment | None,
    name: str,
    placements: list[DeploymentModel],
    count: int,
    pinned: list[GpuHost],
    policy: str,
    lock: bool,
    besides: int | None = None,
    replacing: bool = False,
    physical: bool = False,
) -> list[Choice | str]:
    """Where ``count`` more replicas of the placements would go, one after the
    other, each seeing the ones before: a Choice, or why it fits nowhere.
    ``besides``: a deployment whose replicas the plans leave out; ``replacing``:
    these replace lost replicas (candidate_hosts); ``physical``:
    the placements' GPU ids are the hosts' own (Deployment.physical_gpus)."""
    holding = holding_hosts(candidate_hosts(pinned, lock=lock, replacing=replacing), placements)
    lacking = holding.lacking
    hosts, left_out = gpu_hosts_for_auto(holding.holders + holding.fetchers, placements)
    fetching = {host.pk for host in holding.fetchers}
    holders = selectors.plan_holders_by_host(hosts, besides=besides)
    siblings: Counter[int] = Counter()
    if deployment is not None:
        siblings.update(
            deployment.replica_set.filter(desired_state=DesiredState.RUNNING)
            .exclude(status__in=[S.LOST, S.STOPPED])
            .values_list("host_id", flat=True)
        )
    key = deployment.pk if deployment is not None else None
    choices: list[Choice | str] = []
    notes: str | None = None  # what a refusal adds, worked out at the first
    for n in range(count):
        replica = Holder(key=key, name=name, placements=placements, status="planned", replica=-(n + 1))
        candidates = [Candidate(host=h, holders=holders.get(h.pk, []), siblings=siblings[h.pk]) for h in hosts]
        choose = functools.partial(
            choose_host, replica=replica, pack=policy == PlacementPolicy.PACK, identity=bool(pinned) and not siblings,
            physical=physical,
        )  # fmt: skip
        # Hosts that hold the files first; one that must fetch them when none of those has
        # room, or (spread) when it would hold fewer of the deployment's replicas.
        nearest = [c for c in candidates if c.host.pk not in fetching]
        spread = policy != PlacementPolicy.PACK
        choice = choose(nearest) if nearest or not fetching else None
        if fetching and not (isinstance(choice, Choice) and not (spread and siblings[choice.host.pk])):
            wider = choose(candidates)
            if not isinstance(choice, Choice) or (
                isinstance(wider, Choice) and siblings[wider.host.pk] < siblings[choice.host.pk]
            ):
                choice = wider
        if isinstance(choice, str):
            notes = notes if notes is not None else _refusal_notes(pinned, lacking, left_out)
            choice += notes
        choices.append(choice)
        if isinstance(choice, Choice):
            holders.setdefault(choice.host.pk, []).append(
                Holder(key=key, name=name, placements=placements, status="planned", replica=-(n + 1),
                       gpu_map=choice.gpu_map)
            )  # fmt: skip
            siblings[choice.host.pk] += 1
    return choices


def _next_serial(deployment: Deployment) -> int:
    return (deployment.replica_set.aggregate(top=Max("serial"))["top"] or 0) + 1


def replicas_place(deployment: Deployment, count: int, *, replacing: bool) -> list[Replica]:
    """Create ``count`` replicas of a locked deployment on the hosts chosen for
    them (pending); InvalidTransition with the shortfall when one fits nowhere."""
    choices = replicas_plan_for(deployment, count, replacing=replacing)
    for choice in choices:
        if isinstance(choice, str):
            pinned = list(deployment.pinned_hosts.all())
            where = ", ".join(h.name for h in pinned) if pinned else "any online host"
            done = choices.index(choice)
            raise InvalidTransition(
                f"{deployment.name}'s replica {done + 1} of {count} fits on no host ({where}): {choice}"
            )
    return [replica_create(deployment, choice) for choice in choices]  # type: ignore[arg-type]


def replicas_plan_for(deployment: Deployment, count: int, *, replacing: bool) -> list[Choice | str]:
    """plan_replicas for ``count`` more replicas of a saved deployment (its hosts' rows locked)."""
    return plan_replicas(
        deployment=deployment,
        name=deployment.name,
        placements=list(deployment.placements.select_related("registered_model", "engine_build")),
        count=count,
        pinned=list(deployment.pinned_hosts.all()),
        policy=deployment.placement_policy,
        lock=True,
        replacing=replacing,
        physical=deployment.physical_gpus,
    )


def replica_create(deployment: Deployment, choice: Choice) -> Replica:
    """A pending replica of the deployment's current generation where ``choice`` says."""
    http, grpc, metrics = allocate_ports(choice.host)
    replica = Replica.objects.create(
        deployment=deployment,
        serial=_next_serial(deployment),
        host=choice.host,
        gpu_map={str(k): v for k, v in choice.gpu_map.items()},
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        generation=deployment.generation,
    )
    replica.deployment = deployment
    return replica


def replicas_plan_write(deployment_id: int, *, replica_id: int | None = None) -> None:
    """Store on the deployment's replicas (or the one given) what each runs at
    the deployment's generation now (Replica.plan): the host reads it when it
    launches, applies or checks the replica."""
    deployment = Deployment.objects.get(pk=deployment_id)
    placements = list(deployment.placements.select_related("registered_model", "engine_build"))
    replicas = deployment.replica_set.select_related("host").prefetch_related("host__gpus")
    for replica in replicas.filter(pk=replica_id) if replica_id is not None else replicas:
        plan = backends.replica_plan(placements, replica.gpus, len(replica.host.gpus.all()), deployment.generation)
        Replica.objects.filter(pk=replica.pk).update(plan=plan)


def gpus_words(replica: Replica) -> str:
    """The host GPUs a replica runs on, for people."""
    return ", ".join(str(index) for _, index in sorted(replica.gpus.items())) or "none (CPU)"


def fits_where_it_is(replica: Replica, placements: list[DeploymentModel]) -> list[str]:
    """What is wrong with the replica's host's plan with it there (its host's row locked)."""
    host = GpuHost.objects.select_for_update().prefetch_related("gpus").get(pk=replica.host_id)
    holders = [
        Holder(key=replica.deployment_id, name=replica.deployment.name, placements=placements,
               status=replica.status, replica=replica.serial, gpu_map=replica.gpus),
        *selectors.plan_holders(host, besides_replica=replica.pk),
    ]  # fmt: skip
    gpus = {plan.index for plan in host_plan(host, holders[:1])}
    return plan_problems(host_plan(host, holders), own=replica.deployment_id, gpus=gpus)
