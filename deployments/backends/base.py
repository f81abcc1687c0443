"""What every serving backend answers, and the rules several share.

A backend (tensorrtllm, the LLM API, transformers, the sentence models) is one
module with one ``ServingBackend`` subclass: which placements it serves, the
rules a placement must pass, what it holds of each GPU, the Triton models it
becomes, the context it serves, the plan a replica runs it by, and the host's
model spec. deployments.backends registers them; the rest of Gantry asks the
registry and never tests a placement's backend by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deployments.backends.memory import dtype_bytes, engine_bytes_per_gpu, kv_cache_tokens
from deployments.models import DeploymentModel, Dtype, EngineBuild, InstanceKind, ModelKind, RegisteredModel
from hosts.models import GpuHost

if TYPE_CHECKING:  # the host side's types: triton_server.config needs tritonclient (a worker extra)
    from triton_server.repository import ModelSpec


def _default(name: str) -> Any:
    return DeploymentModel._meta.get_field(name).get_default()


@dataclass(frozen=True)
class PlacementSpec:
    """One model of a deployment as asked for; unset fields take DeploymentModel's defaults."""

    model: str
    triton_name: str = ""
    max_batch_size: int = _default("max_batch_size")
    preferred_batch_sizes: tuple[int, ...] = ()
    # None: 0 for an LLM (it batches in flight: a delay only holds a lone request's first
    # token back), DeploymentModel's default (2000) for the sentence models.
    max_queue_delay_us: int | None = None
    priority_levels: int = _default("priority_levels")
    default_priority_level: int = _default("default_priority_level")
    queue_timeout_us: int = _default("queue_timeout_us")
    max_queue_size: int = _default("max_queue_size")
    timeout_action: str = _default("timeout_action")
    instance_count: int = _default("instance_count")
    instance_kind: str = _default("instance_kind")
    gpu_ids: tuple[int, ...] = ()
    gpu_memory_fraction: float = _default("gpu_memory_fraction")
    # python-backend models (sentence models, the transformers llm): precision and input length.
    dtype: str = _default("dtype")
    max_seq_len: int | None = None
    # llm models: the engine build to serve, and how the backend schedules it.
    engine_build: int | None = None
    llm_api: bool = False  # serve the checkpoint itself through the LLM API (no engine build)
    batch_scheduler_policy: str = _default("batch_scheduler_policy")
    decoupled: bool = _default("decoupled")
    max_num_sequences: int | None = None
    kv_cache_free_gpu_mem_fraction: float | None = None
    max_tokens_in_paged_kv_cache: int | None = None
    enable_kv_cache_reuse: bool = _default("enable_kv_cache_reuse")
    decoding_mode: str = _default("decoding_mode")

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> PlacementSpec:
        """A spec from plain fields (lists where the spec keeps tuples), as the API and revisions hold them."""
        values = {**fields}
        for name in ("preferred_batch_sizes", "gpu_ids"):
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)


def queue_delay_us(spec: PlacementSpec, model: RegisteredModel) -> int:
    """The placement's max_queue_delay_us: as asked, else 0 for an LLM and the stored default for the others."""
    if spec.max_queue_delay_us is not None:
        return spec.max_queue_delay_us
    return 0 if model.kind == ModelKind.LLM else _default("max_queue_delay_us")


@dataclass(frozen=True)
class Resolved:
    """A validated placement: its spec, model, backend, and for an engine (or the
    LLM API) the build, GPUs and KV-cache tokens."""

    spec: PlacementSpec
    model: RegisteredModel
    backend: str
    build: EngineBuild | None = None
    gpus: tuple[int, ...] = ()
    kv_cache_tokens: int | None = None


@dataclass(frozen=True)
class Placed:
    """One placement as a replica runs it, resolved when the replica is placed
    (stored in Replica.plan) so the host reads it instead of working it out:
    its host GPUs, instances, KV-cache budget and lengths."""

    triton_name: str
    backend: str
    instance_kind: str  # KIND_GPU or KIND_CPU: "auto" resolved on the replica's host
    instance_count: int
    gpus: tuple[int, ...]  # the host's GPU indexes
    kv_cache_tokens: int | None = None
    kv_cache_share: float | None = None  # TensorRT-LLM's kv_cache_free_gpu_mem_fraction, the default filled in
    max_seq_len: int | None = None  # what the server is configured with (None: the checkpoint's own)
    max_num_sequences: int | None = None  # sequences generating at once (None: not a generative backend)

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "gpus": list(self.gpus)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Placed:
        return cls(**{**data, "gpus": tuple(data["gpus"])})


Fail = Callable[[str, str], None]


@dataclass(frozen=True)
class Target:
    """Where a deployment's placements are checked: the host (with its GPUs
    prefetched), the runtime and the image its servers run in."""

    host: GpuHost
    runtime: str
    image: str

    def gpus(self) -> dict[int, Any]:
        return {gpu.index: gpu for gpu in self.host.gpus.all()}


class ServingBackend:
    """One way Triton serves a model. Subclasses set ``key`` (a Backend value)
    and ``kinds`` (the model kinds it serves) and answer the methods below;
    the defaults are those of a python-backend model whose instances are
    processes of their own."""

    key: str
    kinds: frozenset[str]
    generative: bool = False  # takes the generate interface (text_input, max_tokens, ... -> text_output)
    # What it takes beyond that interface (inference.generation.EXTRAS), and why not the rest.
    generation_extras: frozenset[str] = frozenset()
    extras_missing: str = ""
    # Chooses its own GPUs when placed (gpu_device_ids): its row is stored as KIND_GPU on them.
    places_own_gpus: bool = False

    def extras(self, placement: DeploymentModel) -> tuple[frozenset[str], str]:
        """What ``placement`` takes beyond the generate interface, and why not the rest."""
        return self.generation_extras, self.extras_missing

    # --- placing ---

    def serves(self, spec: PlacementSpec, model: RegisteredModel) -> bool:
        """Whether this backend is the one ``spec`` asks for (backends are tried in registration order)."""
        return model.kind in self.kinds

    def check(self, spec: PlacementSpec, model: RegisteredModel, target: Target, fail: Fail) -> Resolved | None:
        """Every rule of this backend a placement must pass, each broken one
        reported through ``fail(field, message)``; the resolved placement, or
        None when it cannot even be drawn in a plan."""
        raise NotImplementedError

    def check_deployment(
        self, specs: list[PlacementSpec], resolved: list[Resolved], rows: list[DeploymentModel], host_gpus: list[int]
    ) -> dict[str, list[str]]:
        """This backend's rules of a deployment as a whole (``rows``: the
        unsaved placement rows of ``resolved``), by field."""
        return {}

    # --- GPU memory ---

    def share(self, placement: DeploymentModel) -> float:
        """The part of each of its GPUs the placement holds: its fraction for
        every instance (each is a process that caps its own allocations)."""
        return placement.gpu_memory_fraction * placement.instance_count

    def processes_per_gpu(self, placement: DeploymentModel) -> int:
        """Server processes it adds on each of its GPUs (each holds a CUDA context)."""
        return placement.instance_count

    def memory(self, placement: DeploymentModel) -> dict[str, Any]:
        """What its share holds, in bytes, as the plan shows it."""
        return {}

    # --- names and context ---

    def triton_models(self, triton_name: str) -> list[str]:
        """The Triton models the placement becomes, in load order."""
        return [triton_name]

    def served_context(self, placement: DeploymentModel) -> int | None:
        """The most tokens (prompt and output) one sequence may hold."""
        return placement.max_seq_len or placement.registered_model.max_position_embeddings

    # --- the replica's plan and the host's spec ---

    def placed(self, placement: DeploymentModel, kind: str, host_gpus: tuple[int, ...]) -> Placed:
        """The placement as a replica runs it: instances of ``kind`` (KIND_GPU or
        KIND_CPU) on ``host_gpus`` (its GPUs, mapped onto the host's)."""
        return Placed(
            triton_name=placement.triton_name, backend=self.key, instance_kind=kind,
            instance_count=placement.instance_count, gpus=host_gpus, max_seq_len=placement.max_seq_len,
        )  # fmt: skip

    def model_spec(self, placement: DeploymentModel, placed: Placed, devices: tuple[int, ...], image: str) -> ModelSpec:
        """What the host writes into the Triton repository; ``devices`` are the
        placed GPUs as the server sees them. Runs on the host only."""
        raise NotImplementedError

    def world_size(self, placement: DeploymentModel) -> int:
        """MPI ranks the server needs for this placement."""
        return 1

    def rank_models(self, placement: DeploymentModel) -> list[str]:
        """Models the ranks above 0 load (a multi-GPU engine's)."""
        return []

    def mounts(self, placement: DeploymentModel) -> set[Path]:
        """Folders the server reads (mounted read-only into a container)."""
        return {placement.registered_model.folder}

    def server_env(self, placement: DeploymentModel, repository: Path) -> dict[str, str]:
        """Environment the server needs for this placement."""
        return {}


# --- rules several backends share ------------------------------------------------


def refuse_engine_only(spec: PlacementSpec, fail: Fail, what: str) -> None:
    """Settings only an engine or the LLM API reads, refused by name elsewhere."""
    if spec.kv_cache_free_gpu_mem_fraction is not None:
        fail("kv_cache_free_gpu_mem_fraction", f"TensorRT-LLM's KV-cache share; {what} has none to set")
    if spec.max_tokens_in_paged_kv_cache is not None:
        fail("max_tokens_in_paged_kv_cache", f"TensorRT-LLM's paged KV cache; {what} has none")
    if spec.enable_kv_cache_reuse:
        fail("enable_kv_cache_reuse", f"TensorRT-LLM's KV-cache reuse; {what} cannot reuse a cache")
    if spec.decoding_mode:
        fail("decoding_mode", f"the tensorrtllm backend's decoding mode; {what} samples per request")


def check_precision(
    spec: PlacementSpec, kind: str, gpus: tuple[int, ...], host_gpus: dict[int, Any], fail: Fail
) -> None:
    """16-bit weights run on a GPU; bfloat16 needs compute capability 8.0 or later."""
    if spec.dtype in (Dtype.FLOAT16, Dtype.BFLOAT16) and kind != InstanceKind.GPU:
        fail("dtype", f"{spec.dtype} runs on a GPU; these instances run on the CPU (use float32 or auto)")
    if spec.dtype == Dtype.BFLOAT16:
        for index in gpus:
            gpu = host_gpus.get(index)
            if gpu is not None and _capability(gpu.compute_capability) < (8, 0):
                fail("dtype", f"bfloat16 needs compute capability 8.0; GPU {index} is {gpu.compute_capability}")


def _capability(value: str) -> tuple[int, int]:
    major, _, minor = value.partition(".")
    return (int(major or 0), int(minor or 0))


def check_max_seq_len(spec: PlacementSpec, model: RegisteredModel, fail: Fail) -> None:
    """A length asked for fits the checkpoint's positions."""
    limit = model.max_position_embeddings
    if spec.max_seq_len is not None and limit and spec.max_seq_len > limit:
        fail("max_seq_len", f"must be at most {limit}, {model.name}'s max_position_embeddings")


def element_bytes(spec: PlacementSpec, kind: str) -> int:
    """Bytes per weight as the model will load: auto is 16-bit on a GPU, fp32 on a CPU."""
    if spec.dtype == Dtype.AUTO:
        return 2 if kind == InstanceKind.GPU else 4
    return dtype_bytes(spec.dtype)


def batching(placement: DeploymentModel) -> Any:
    """Triton's dynamic batcher as the placement sets it (host side)."""
    from triton_server.config import Batching

    return Batching(
        max_batch_size=placement.max_batch_size,
        preferred_batch_sizes=tuple(placement.preferred_batch_sizes),
        max_queue_delay_us=placement.max_queue_delay_us,
        priority_levels=placement.priority_levels,
        default_priority_level=placement.default_priority_level,
        queue_timeout_us=placement.queue_timeout_us,
        max_queue_size=placement.max_queue_size,
        timeout_action=placement.timeout_action,
    )


def kv_budget(
    spec: PlacementSpec, model: RegisteredModel, build: EngineBuild | None, memory: int, gpus: int,
    sequence: int, fail: Fail,
) -> int | None:  # fmt: skip
    """The absolute KV-cache token budget of an engine or the LLM API: the share
    (kv_cache_free_gpu_mem_fraction) of what the fraction leaves after the
    weights, or the tokens asked for, which must fit there. It must hold one
    ``sequence``-token sequence."""
    try:
        planned = kv_cache_tokens(
            model=model, build=build, fraction=spec.gpu_memory_fraction, gpu_memory_bytes=memory, tp_size=gpus,
            kv_share=spec.kv_cache_free_gpu_mem_fraction,
        )  # fmt: skip
        room = kv_cache_tokens(
            model=model, build=build, fraction=spec.gpu_memory_fraction, gpu_memory_bytes=memory, tp_size=gpus,
            kv_share=1.0,
        )  # fmt: skip
    except ValueError as exc:
        fail("model", str(exc))
        return None
    weights = (engine_bytes_per_gpu(build) if build else model.size_bytes / gpus) / 2**30
    if spec.max_tokens_in_paged_kv_cache is not None:
        if spec.max_tokens_in_paged_kv_cache > room:
            fail(
                "max_tokens_in_paged_kv_cache",
                f"{spec.max_tokens_in_paged_kv_cache} tokens do not fit: {spec.gpu_memory_fraction:g} of "
                f"{memory / 2**30:.0f} GiB holds at most {max(room, 0)} after the {weights:.1f} GiB of weights per GPU",
            )
        elif spec.max_tokens_in_paged_kv_cache < sequence:
            fail("max_tokens_in_paged_kv_cache", f"must hold at least one {sequence}-token sequence")
        return spec.max_tokens_in_paged_kv_cache
    if planned < sequence:
        what = "the engine's" if build else "the"
        fail(
            "gpu_memory_fraction",
            f"{spec.gpu_memory_fraction:g} of {memory / 2**30:.0f} GiB leaves room for {max(planned, 0)} "
            f"KV-cache tokens after {what} {weights:.1f} GiB per GPU: not even one {sequence}-token sequence",
        )
    return planned
