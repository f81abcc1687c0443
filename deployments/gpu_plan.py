"""GPU memory planning, in one place: what each placement asks of each GPU it
runs on, and the one plan per host that every deployment on it shares.

A GPU's plan holds every model instance that a deployment running on the host
(or wanting to run) places there, plus what is being asked for now. It checks
the seeds' rule (the memory shares of all models together stay within
GANTRY_GPU_MEMORY_HEADROOM, 0.95 by default) and that what the shares leave
holds a CUDA context for every server process on the GPU
(GANTRY_GPU_PROCESS_RESERVE_MIB each: each python-backend instance is a
process of its own, and tritonserver holds one too).

A share is a fraction of the GPU times the placement's instances: every
instance is a process that caps its own allocations at the fraction. What a
share holds, and how many processes it brings, each backend says
(deployments.backends): an engine's files and its KV-cache tokens, the LLM
API's weights and KV cache, the transformers path's weights, KV cache and
activations.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from deployments.backends import backend_of
from deployments.backends.memory import placement_gpus
from deployments.models import DeploymentModel


def processes_per_gpu(placement: DeploymentModel) -> int:
    """Server processes a placement adds on each of its GPUs (each holds a CUDA
    context): one per python-backend instance; an engine runs inside
    tritonserver; the LLM API's python model drives an executor process."""
    return backend_of(placement).processes_per_gpu(placement)


def share_of(placement: DeploymentModel) -> float:
    """The part of each of its GPUs a placement holds (ServingBackend.share)."""
    return backend_of(placement).share(placement)


@dataclass(frozen=True)
class Holder:
    """A replica (or a deployment about to have one) whose placements count on a
    host's GPUs: its placements' GPU numbers go through ``gpu_map`` onto the
    host's (a number it does not map is the host's own)."""

    key: int | None  # the deployment's id (None: one not saved yet)
    name: str
    placements: list[DeploymentModel]
    status: str = ""  # for the plan's words: "ready", "launching", ...
    replica: int = 0  # its serial (0: not placed yet): each replica is a server of its own
    gpu_map: dict[int, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.name} r{self.replica}" if self.replica else self.name


@dataclass
class GpuPlan:
    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    headroom: float
    reserve_bytes: int
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return round(sum(row["share"] for row in self.rows), 6)

    @property
    def processes(self) -> int:
        # Each replica's tritonserver holds a context on every GPU it uses.
        servers = {(row["deployment_id"], row["replica"]) for row in self.rows}
        return sum(row["processes"] for row in self.rows) + len(servers)

    @property
    def within_headroom(self) -> bool:
        return self.fraction <= self.headroom + 1e-9

    @property
    def context_bytes(self) -> int:
        return self.processes * self.reserve_bytes

    @property
    def contexts_fit(self) -> bool:
        return self.context_bytes <= (1 - self.fraction) * self.memory_total_bytes

    def problems(self, *, own: int | None) -> list[str]:
        """What is wrong with this GPU's plan, naming the other deployments that hold it."""
        others = sorted(
            {
                f"{row['deployment']} ({row['deployment_status'] or 'planned'})"
                for row in self.rows
                if row["deployment_id"] != own
            }
        )
        beside = f" together with {', '.join(others)}" if others else ""
        found = []
        if not self.within_headroom:
            found.append(
                f"GPU {self.index}: memory fractions add up to {self.fraction:.2f}{beside}, "
                f"above the headroom limit {self.headroom:.2f}"
            )
        elif not self.contexts_fit:
            left = (1 - self.fraction) * self.memory_total_bytes
            found.append(
                f"GPU {self.index}: {self.processes} server processes{beside} need "
                f"{self.context_bytes / 2**30:.1f} GiB for their CUDA contexts "
                f"({self.reserve_bytes // 2**20} MiB each, GANTRY_GPU_PROCESS_RESERVE_MIB), "
                f"but the fractions leave {left / 2**30:.1f} GiB"
            )
        return found

    def as_dict(self, *, own: int | None = None) -> dict[str, Any]:
        return {
            "gpu": self.index,
            "name": self.name,
            "uuid": self.uuid,
            "memory_total_bytes": self.memory_total_bytes,
            "models": [{**row, "own": row["deployment_id"] == own} for row in self.rows],
            "fraction": self.fraction,
            "headroom": self.headroom,
            "within_headroom": self.within_headroom,
            "processes": self.processes,
            "process_reserve_bytes": self.reserve_bytes,
            "contexts_fit": self.contexts_fit,
            "problems": self.problems(own=own),
        }


def host_plan(host: Any, holders: Iterable[Holder]) -> list[GpuPlan]:
    """The plan of every GPU of ``host`` that a holder places something on."""
    gpus = {gpu.index: gpu for gpu in host.gpus.all()}
    reserve = settings.GANTRY_GPU_PROCESS_RESERVE_MIB * 2**20
    plans = {
        index: GpuPlan(index=index, name=gpu.name, uuid=gpu.uuid, memory_total_bytes=gpu.memory_total_bytes,
                       headroom=settings.GANTRY_GPU_MEMORY_HEADROOM, reserve_bytes=reserve)
        for index, gpu in gpus.items()
    }  # fmt: skip
    for holder in holders:
        for placement in holder.placements:
            for index in replica_gpus(placement, holder.gpu_map, len(gpus)):
                plan = plans.get(index)
                if plan is None:
                    continue
                share = share_of(placement)
                processes = processes_per_gpu(placement)
                plan.rows.append(
                    {
                        "deployment": holder.label,
                        "deployment_id": holder.key,
                        "replica": holder.replica,
                        "deployment_status": holder.status,
                        "triton_name": placement.triton_name,
                        "backend": placement.backend,
                        "fraction": placement.gpu_memory_fraction,
                        "instances": placement.instance_count,
                        "share": round(share, 6),
                        "bytes": int(share * plan.memory_total_bytes),
                        "processes": processes,
                        # What NVML may show its processes holding: the share and their contexts.
                        "nvml_budget_bytes": int(share * plan.memory_total_bytes) + processes * reserve,
                        **backend_of(placement).memory(placement),
                    }
                )
    return [plan for plan in plans.values() if plan.rows]


def plan_problems(plans: list[GpuPlan], *, own: int | None, gpus: Iterable[int] | None = None) -> list[str]:
    """What is wrong with ``plans`` (only those of ``gpus``, if given)."""
    wanted = None if gpus is None else set(gpus)
    return [problem for plan in plans if wanted is None or plan.index in wanted for problem in plan.problems(own=own)]


def logical_gpus(placements: Iterable[DeploymentModel], gpu_count: int) -> tuple[int, ...]:
    """The deployment's own GPU numbers its placements use, on a host with
    ``gpu_count`` GPUs (none when it has none: every placement runs on its CPU)."""
    return tuple(sorted({g for p in placements for g in placement_gpus(p, range(gpu_count))}))


def replica_gpus(placement: DeploymentModel, gpu_map: dict[int, int], gpu_count: int) -> tuple[int, ...]:
    """The host GPUs a placement's processes use in a replica mapped by ``gpu_map``."""
    return tuple(gpu_map.get(g, g) for g in placement_gpus(placement, range(gpu_count)))


# --- choosing where a replica runs ------------------------------------------------


@dataclass(frozen=True)
class Choice:
    host: Any
    gpu_map: dict[int, int]


@dataclass(frozen=True)
class Candidate:
    """A host a replica may go to: what already holds its GPUs, and how many
    replicas of the same deployment it carries."""

    host: Any
    holders: list[Holder]
    siblings: int = 0


def _room(plan: GpuPlan | None) -> float:
    """What a GPU has left within the headroom (all of it when nothing holds it)."""
    return plan.headroom - plan.fraction if plan is not None else settings.GANTRY_GPU_MEMORY_HEADROOM


def _within(replica: Holder, gpu_map: dict[int, int], gpu_count: int) -> Holder:
    """The replica as far as ``gpu_map`` places it: the placements whose GPUs are all mapped."""
    placed = [p for p in replica.placements if set(placement_gpus(p, range(gpu_count))) <= gpu_map.keys()]
    return Holder(**{**replica.__dict__, "placements": placed, "gpu_map": gpu_map})


def _problems(candidate: Candidate, replica: Holder, gpu_map: dict[int, int]) -> list[str]:
    """What would be wrong with the GPUs of ``gpu_map`` with the replica mapped so."""
    mapped = _within(replica, gpu_map, len(candidate.host.gpus.all()))
    plans = host_plan(candidate.host, [mapped, *candidate.holders])
    return plan_problems(plans, own=replica.key, gpus=gpu_map.values())


def _map_on(
    candidate: Candidate, replica: Holder, *, pack: bool, identity: bool, physical: bool = False
) -> tuple[dict[int, int] | None, str]:
    """A mapping of the replica's GPUs onto distinct GPUs of the host that keeps
    every GPU's plan sound, or None and the shortfall in words. With ``identity``
    its own GPU numbers are tried first; with ``physical`` they are the only
    mapping (they name the host's own GPUs). Then each of its GPUs, the most
    demanding first, goes to the host GPU with the most room (spread) or the
    least room that still fits (pack)."""
    host = candidate.host
    indexes = sorted(gpu.index for gpu in host.gpus.all())
    logical = logical_gpus(replica.placements, len(indexes))
    if len(logical) > len(indexes):
        return None, f"{host.name} has {len(indexes)} GPU(s); the placements use {len(logical)}"
    if physical:
        absent = sorted(set(logical) - set(indexes))
        if absent:
            return None, f"{host.name} has no GPU {', '.join(map(str, absent))} (physical GPU ids)"
        problems = _problems(candidate, replica, {g: g for g in logical})
        if problems:
            return None, f"{host.name}'s GPU(s) {', '.join(map(str, logical))} (physical): {'; '.join(problems)}"
        return {g: g for g in logical}, ""
    if identity and set(logical) <= set(indexes) and not _problems(candidate, replica, {g: g for g in logical}):
        return {g: g for g in logical}, ""
    plans = {plan.index: plan for plan in host_plan(host, candidate.holders)}

    def demand(g: int) -> float:
        return sum(share_of(p) for p in replica.placements if g in placement_gpus(p, range(len(indexes))))

    gpu_map: dict[int, int] = {}
    for g in sorted(logical, key=lambda g: (-demand(g), g)):
        free = [i for i in indexes if i not in gpu_map.values()]
        free.sort(key=lambda i: (_room(plans.get(i)) if pack else -_room(plans.get(i)), i))
        chosen = next((i for i in free if not _problems(candidate, replica, {**gpu_map, g: i})), None)
        if chosen is None:
            best = max(free, key=lambda i: (_room(plans.get(i)), -i))
            room = max(0.0, _room(plans.get(best)))
            problems = "; ".join(_problems(candidate, replica, {**gpu_map, g: best}))
            if demand(g) > room:
                return None, f"{host.name} is short by {demand(g) - room:.2f} of GPU {best}'s memory: {problems}"
            return None, f"{host.name}: {problems}"
        gpu_map[g] = chosen
    return gpu_map, ""


def choose_host(
    candidates: list[Candidate], replica: Holder, *, pack: bool = False, identity: bool = False, physical: bool = False
) -> Choice | str:
    """Where ``replica`` runs: the candidate hosts in order of preference (spread:
    fewest replicas of its deployment, then most room; pack: most of them, then
    least room), the first on which its GPUs map soundly. When none fits, the
    best host's shortfall in words (the host that came closest)."""

    def room(candidate: Candidate) -> float:
        plans = {plan.index: plan for plan in host_plan(candidate.host, candidate.holders)}
        return sum(_room(plans.get(gpu.index)) for gpu in candidate.host.gpus.all())

    def preference(candidate: Candidate) -> tuple:
        if pack:
            return (-candidate.siblings, room(candidate), candidate.host.name)
        return (candidate.siblings, -room(candidate), candidate.host.name)

    shortfalls: list[str] = []
    for candidate in sorted(candidates, key=preference):
        gpu_map, shortfall = _map_on(candidate, replica, pack=pack, identity=identity, physical=physical)
        if gpu_map is not None:
            return Choice(host=candidate.host, gpu_map=gpu_map)
        shortfalls.append(shortfall)
    if not candidates:
        return "no online host to run it on"
    return shortfalls[0]
