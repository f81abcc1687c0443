"""The arithmetic of a model's GPU memory that several backends share: which
GPUs its instances take, bytes per weight and per KV-cache token, and the
KV-cache tokens of TensorRT-LLM (an engine or the LLM API)."""

from __future__ import annotations

from collections.abc import Iterable

from deployments.models import DeploymentModel, EngineBuild, InstanceKind, RegisteredModel

# Of an engine's budget left after its weights, the share TensorRT-LLM gives its
# KV cache unless the placement says otherwise (kv_cache_free_gpu_mem_fraction).
DEFAULT_KV_CACHE_SHARE = 0.9


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


def kv_share(placement_share: float | None) -> float:
    """TensorRT-LLM's kv_cache_free_gpu_mem_fraction, its default filled in."""
    return DEFAULT_KV_CACHE_SHARE if placement_share is None else placement_share


def engine_memory(model: RegisteredModel, build: EngineBuild | None, gpu_ids: list[int], tokens: int | None) -> dict:
    """What an engine's or the LLM API's share holds, as the plan shows it."""
    tp = len(gpu_ids) or 1
    per_token = kv_bytes_per_token(model, build, tp_size=tp)
    return {
        "engine_bytes": weights_bytes_per_gpu(model, build, tp_size=tp),
        "kv_cache_tokens": tokens,
        "kv_cache_bytes": (tokens or 0) * per_token,
    }
