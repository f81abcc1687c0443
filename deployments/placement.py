"""Where a placement's model instances run, and how much GPU memory an
engine's KV cache gets: decided once, for validation, the plan and the host
that writes the Triton config."""

from __future__ import annotations

from collections.abc import Iterable

from deployments.models import Backend, DeploymentModel, EngineBuild, InstanceKind, RegisteredModel

# Of an engine's budget left after its weights, the share given to the KV cache;
# the rest holds activations and the runtime's own buffers.
KV_CACHE_SHARE = 0.9


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


def triton_model_names(placements: Iterable[DeploymentModel]) -> list[str]:
    """The Triton models the placements become, in load order: an engine placement
    is its engine, its tokenizer models and the ensemble clients call by the
    placement's name (matches workers.triton.config.TrtllmSpec.model_names)."""
    names = []
    for p in placements:
        if p.backend == Backend.TENSORRTLLM:
            names += [f"{p.triton_name}-engine", f"{p.triton_name}-preprocessing", f"{p.triton_name}-postprocessing"]
        names.append(p.triton_name)
    return names


def kv_bytes_per_token(model: RegisteredModel, build: EngineBuild | None, *, tp_size: int = 1) -> int:
    """KV-cache bytes one token takes on each GPU: keys and values for every
    layer and KV head, split across the tensor- and pipeline-parallel ranks;
    an fp8 engine stores its cache in one byte. Without a build (LLM API) the
    checkpoint runs in 16 bits on ``tp_size`` GPUs."""
    if not (model.num_layers and model.num_kv_heads and model.head_dim):
        raise ValueError(f"{model.name}'s config.json gives no layer, KV head or head size")
    tp, pp = (build.tp_size, build.pp_size) if build else (tp_size, 1)
    dtype_bytes = 1 if build and build.spec.get("quantization") == "fp8" else 2
    layers = -(-model.num_layers // pp)
    heads = max(1, model.num_kv_heads // tp)
    return 2 * layers * heads * model.head_dim * dtype_bytes


def engine_bytes_per_gpu(build: EngineBuild) -> int:
    return build.engine_size_bytes // max(1, build.world_size)


def weights_bytes_per_gpu(model: RegisteredModel, build: EngineBuild | None, *, tp_size: int = 1) -> int:
    """The engine files' real size per GPU; without a build, the checkpoint's."""
    return engine_bytes_per_gpu(build) if build else model.size_bytes // max(1, tp_size)


def kv_cache_tokens(
    *, model: RegisteredModel, build: EngineBuild | None, fraction: float, gpu_memory_bytes: int, tp_size: int = 1
) -> int:
    """Absolute KV-cache token budget for a model given ``fraction`` of each of
    its GPUs: what is left after its weights, less a reserve, in tokens. Zero or
    less means the fraction cannot even hold the weights."""
    budget = fraction * gpu_memory_bytes - weights_bytes_per_gpu(model, build, tp_size=tp_size)
    return int(budget * KV_CACHE_SHARE) // kv_bytes_per_token(model, build, tp_size=tp_size)
