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
instance is a process that caps its own allocations at the fraction. What the
share must hold is planned per backend: an engine's files and its KV-cache
tokens, the LLM API's weights and KV cache, and for the transformers path the
16-bit weights, a KV cache for max_num_sequences sequences of max_seq_len
tokens (allocated at load: python_models/gantry_decode.py), and the activations
of one prefill chunk.

Over 450 lines on purpose: the shares, the contexts, the KV budgets and where a
replica fits (choose_host) are one arithmetic over one plan, and every door
that shows or checks a plan reads it from here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from deployments.models import Backend, DeploymentModel, EngineBuild, InstanceKind, RegisteredModel

# Of an engine's budget left after its weights, the share TensorRT-LLM gives its
# KV cache unless the placement says otherwise (kv_cache_free_gpu_mem_fraction).
DEFAULT_KV_CACHE_SHARE = 0.9
# The transformers path prefills at most this many (padded) prompt tokens per
# forward pass (python_models/gantry_decode.py), so its activations are bounded.
PREFILL_TOKENS = 4096
# The context a transformers placement serves when it names none: the checkpoint's,
# capped so that a long-context checkpoint does not plan its KV cache for 128k tokens.
DEFAULT_MAX_SEQ_LEN = 4096
# A model with sliding-window (or other non-full) attention layers decodes with
# its own growing cache, which is re-allocated as it grows (old and new copies
# live together for a moment): its KV cache is planned twice. Full attention
# uses the decoder's slot cache, allocated once.
GROWING_CACHE_COPIES = 2


def kv_cache_sequences(config: dict[str, Any], max_num_sequences: int, max_seq_len: int) -> int:
    """How many sequences of max_seq_len tokens a transformers LLM's KV cache holds at
    once: the slot cache's, one slot per sequence and a scratch one (every layer full
    attention within max_seq_len), else GROWING_CACHE_COPIES times them (the same
    rule as gantry_decode.Decoder's)."""
    window = config.get("sliding_window")
    kinds = set(config.get("layer_types") or ["full_attention"])
    if (window and window < max_seq_len) or kinds != {"full_attention"}:
        return GROWING_CACHE_COPIES * max_num_sequences
    return max_num_sequences + 1


def resolve_instances(
    instance_kind: str, gpu_ids: Iterable[int], host_gpus: Iterable[int]
) -> tuple[str, tuple[int, ...]]:
    """(KIND_CPU or KIND_GPU, GPU indexes): "auto" means GPU when the host has one;
    a GPU placement without explicit GPUs takes the host's first."""
    host = sorted(host_gpus)
    kind = instance_kind
    if kind == InstanceKind.AUTO:
        kind = InstanceKind.GPU if host else InstanceKind.CPU
    if kind == InstanceKind.CPU:
        return InstanceKind.CPU.value, ()
    return InstanceKind.GPU.value, tuple(gpu_ids) or tuple(host[:1])


def placement_gpus(placement: DeploymentModel, host_gpus: Iterable[int]) -> tuple[int, ...]:
    """The host GPUs a placement's server processes use (none on the CPU). An
    engine's or the LLM API's GPUs are stored with instance kind KIND_GPU, so
    the one rule covers every backend."""
    return resolve_instances(placement.instance_kind, placement.gpu_ids, host_gpus)[1]


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def kv_bytes_per_token(
    model: RegisteredModel, build: EngineBuild | None, *, tp_size: int = 1, element_bytes: int = 2
) -> int:
    """KV-cache bytes one token takes on each GPU: keys and values for every
    layer and KV head, split across the tensor- and pipeline-parallel ranks;
    an fp8 engine stores its cache in one byte. Without a build the checkpoint
    runs on ``tp_size`` GPUs in ``element_bytes`` per value."""
    if not (model.num_layers and model.num_kv_heads and model.head_dim):
        raise ValueError(f"{model.name}'s config.json gives no layer, KV head or head size")
    tp, pp = (build.tp_size, build.pp_size) if build else (tp_size, 1)
    if build is not None:
        element_bytes = 1 if build.spec.get("quantization") == "fp8" else 2
    layers = -(-model.num_layers // pp)
    heads = max(1, model.num_kv_heads // tp)
    return 2 * layers * heads * model.head_dim * element_bytes


def engine_bytes_per_gpu(build: EngineBuild) -> int:
    return build.engine_size_bytes // max(1, build.world_size)


def weights_bytes_per_gpu(model: RegisteredModel, build: EngineBuild | None, *, tp_size: int = 1) -> int:
    """The engine files' real size per GPU; without a build, the checkpoint's weights."""
    return engine_bytes_per_gpu(build) if build else model.size_bytes // max(1, tp_size)


def kv_cache_tokens(
    *,
    model: RegisteredModel,
    build: EngineBuild | None,
    fraction: float,
    gpu_memory_bytes: int,
    tp_size: int = 1,
    kv_share: float | None = None,
) -> int:
    """Absolute KV-cache token budget for a model given ``fraction`` of each of
    its GPUs: the ``kv_share`` of what is left after its weights, in tokens.
    Zero or less means the fraction cannot even hold the weights."""
    share = DEFAULT_KV_CACHE_SHARE if kv_share is None else kv_share
    budget = fraction * gpu_memory_bytes - weights_bytes_per_gpu(model, build, tp_size=tp_size)
    return int(budget * share) // kv_bytes_per_token(model, build, tp_size=tp_size)


def transformers_max_seq_len(model: RegisteredModel, asked: int | None) -> int:
    """The context a transformers placement serves: what it asks, else the
    checkpoint's up to DEFAULT_MAX_SEQ_LEN."""
    if asked:
        return asked
    return min(model.max_position_embeddings or DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_SEQ_LEN)


@dataclass(frozen=True)
class TransformersNeeds:
    """What one instance of a transformers LLM holds on its GPU, in bytes."""

    weights: int
    kv_cache: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations


def transformers_needs(
    model: RegisteredModel, *, max_num_sequences: int, max_seq_len: int, element_bytes: int = 2
) -> TransformersNeeds:
    """The 16-bit (or fp32) weights, a KV cache for ``max_num_sequences`` sequences of
    ``max_seq_len`` tokens (kv_cache_sequences), and the
    activations of one prefill pass of PREFILL_TOKENS tokens (or one whole
    sequence, if longer) plus the logits of a decode step."""
    parameters = model.parameter_count or model.size_bytes // 2
    config = model.config or {}
    hidden = model.hidden_size or 0
    intermediate = int(config.get("intermediate_size") or 4 * hidden)
    vocab = model.vocab_size or int(config.get("vocab_size") or 0)
    kv = (
        kv_cache_sequences(config, max_num_sequences, max_seq_len)
        * max_seq_len
        * kv_bytes_per_token(model, None, element_bytes=element_bytes)
    )
    tokens = max(PREFILL_TOKENS, max_seq_len)
    # The MLP's gate, up and activation buffers and a few hidden-sized ones per token,
    # and fp32 logits for every sequence of a decode step.
    activations = tokens * (3 * intermediate + 6 * hidden) * element_bytes + max_num_sequences * vocab * 4
    return TransformersNeeds(weights=parameters * element_bytes, kv_cache=kv, activations=activations)


def processes_per_gpu(placement: DeploymentModel) -> int:
    """Server processes a placement adds on each of its GPUs (each holds a CUDA
    context): one per python-backend instance; an engine runs inside
    tritonserver; the LLM API's python model drives an executor process."""
    if placement.backend == Backend.TENSORRTLLM:
        return 0
    if placement.backend == Backend.LLM_API:
        return 2
    return placement.instance_count


def share_of(placement: DeploymentModel) -> float:
    """The part of each of its GPUs a placement holds: its fraction for every
    instance that caps itself at it (an engine and the LLM API run one)."""
    if placement.backend in (Backend.TENSORRTLLM, Backend.LLM_API):
        return placement.gpu_memory_fraction
    return placement.gpu_memory_fraction * placement.instance_count


def _details(placement: DeploymentModel, memory_total_bytes: int) -> dict[str, Any]:
    """What a placement's share holds, as the plan shows it."""
    model, build = placement.registered_model, placement.engine_build
    if placement.backend in (Backend.TENSORRTLLM, Backend.LLM_API):
        tp = len(placement.gpu_ids) or 1
        per_token = kv_bytes_per_token(model, build, tp_size=tp)
        return {
            "engine_bytes": weights_bytes_per_gpu(model, build, tp_size=tp),
            "kv_cache_tokens": placement.kv_cache_tokens,
            "kv_cache_bytes": (placement.kv_cache_tokens or 0) * per_token,
        }
    if placement.backend == Backend.TRANSFORMERS and placement.instance_kind != InstanceKind.CPU:
        try:
            needs = transformers_needs(
                model,
                max_num_sequences=placement.max_num_sequences or placement.max_batch_size,
                max_seq_len=transformers_max_seq_len(model, placement.max_seq_len),
                element_bytes=dtype_bytes(placement.dtype),
            )
        except ValueError:
            return {}
        return {"weights_bytes": needs.weights, "kv_cache_bytes": needs.kv_cache, "activation_bytes": needs.activations}
    return {}


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
                        **_details(placement, plan.memory_total_bytes),
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


def _map_on(candidate: Candidate, replica: Holder, *, pack: bool, identity: bool) -> tuple[dict[int, int] | None, str]:
    """A mapping of the replica's GPUs onto distinct GPUs of the host that keeps
    every GPU's plan sound, or None and the shortfall in words. With ``identity``
    its own GPU numbers are tried first. Then each of its GPUs, the most
    demanding first, goes to the host GPU with the most room (spread) or the
    least room that still fits (pack)."""
    host = candidate.host
    indexes = sorted(gpu.index for gpu in host.gpus.all())
    logical = logical_gpus(replica.placements, len(indexes))
    if len(logical) > len(indexes):
        return None, f"{host.name} has {len(indexes)} GPU(s); the placements use {len(logical)}"
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
    candidates: list[Candidate], replica: Holder, *, pack: bool = False, identity: bool = False
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
        gpu_map, shortfall = _map_on(candidate, replica, pack=pack, identity=identity)
        if gpu_map is not None:
            return Choice(host=candidate.host, gpu_map=gpu_map)
        shortfalls.append(shortfall)
    if not candidates:
        return "no online host to run it on"
    return shortfalls[0]
