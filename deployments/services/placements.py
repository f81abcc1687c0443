"""Model placements: what one model of a deployment asks of its host (batching,
instances, GPUs and memory, and for an llm the engine or LLM-API path), the
rules a set of placements must pass before anything is written, and their
snapshots in revisions.

A placement's fields, defaults and bounds are defined once, on
``DeploymentModel``; ``PlacementSpec`` takes its defaults from there and the
API serializer and the browser form derive their fields from it.

Over 450 lines on purpose: the rules of the three LLM paths (engine, LLM API,
transformers) and of the sentence models sit beside the rules they share, so
one read shows every rule a placement passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from django.conf import settings
from django.core.validators import MaxValueValidator

from common.errors import ValidationFailed
from common.words import a
from deployments import trtllm
from deployments.gpu_plan import (
    Holder,
    dtype_bytes,
    engine_bytes_per_gpu,
    host_plan,
    kv_cache_tokens,
    placement_gpus,
    plan_problems,
    resolve_instances,
    transformers_max_seq_len,
    transformers_needs,
)
from deployments.models import (
    Backend,
    BuildStatus,
    DecodingMode,
    Deployment,
    DeploymentModel,
    Dtype,
    EngineBuild,
    Inspection,
    InstanceKind,
    ModelKind,
    RegisteredModel,
    Runtime,
    TimeoutAction,
)
from hosts.models import GpuHost

# Kinds this version can place in a deployment, and the backend each uses.
SERVABLE_KINDS = {
    ModelKind.EMBEDDING: Backend.PYTHON,
    ModelKind.RERANKER: Backend.PYTHON,
    ModelKind.LLM: Backend.TENSORRTLLM,  # or LLM_API, or TRANSFORMERS: see _llm_backend
}


def _default(name: str) -> Any:
    return DeploymentModel._meta.get_field(name).get_default()


@dataclass(frozen=True)
class PlacementSpec:
    """One model of a deployment as asked for; unset fields take DeploymentModel's defaults."""

    model: str
    triton_name: str = ""
    max_batch_size: int = _default("max_batch_size")
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = _default("max_queue_delay_us")
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


# Every field a placement request may carry, in PlacementSpec's order.
PLACEMENT_FIELDS = tuple(f.name for f in fields(PlacementSpec))
MAX_BATCH_SIZE = min(
    v.limit_value
    for v in DeploymentModel._meta.get_field("max_batch_size").validators
    if isinstance(v, MaxValueValidator)
)


@dataclass(frozen=True)
class Resolved:
    """A validated placement: its spec, model, and for an engine (or the LLM API)
    the build, GPUs and KV-cache tokens."""

    spec: PlacementSpec
    model: RegisteredModel
    build: EngineBuild | None = None
    gpus: tuple[int, ...] = ()
    kv_cache_tokens: int | None = None


Fail = Callable[[str, str], None]


def _check_llm(
    spec: PlacementSpec, model: RegisteredModel, host: GpuHost, runtime: str, image: str, fail: Fail
) -> Resolved | None:
    """An llm takes one of three paths: its engine build, the LLM API, or (neither
    named) transformers on the python backend. The gates an engine passes
    before it is placed: built and verified, in the image it will run in (same
    digest, same TensorRT-LLM), for this GPU's SM, on exactly tp*pp GPUs, with
    a batch size it was built for, and a memory fraction that holds its weights
    and leaves room for a KV cache."""
    if spec.engine_build is None and spec.llm_api:
        return _check_llm_api(spec, model, host, runtime, image, fail)
    if spec.engine_build is None:
        return _check_transformers(spec, model, host, fail)
    if spec.llm_api:
        fail("llm_api", "serves the checkpoint without an engine: leave engine_build empty")
    build = EngineBuild.objects.filter(pk=spec.engine_build).first()
    if build is None:
        fail("engine_build", f"no engine build {spec.engine_build}")
        return None
    if build.model_id != model.pk:
        fail("engine_build", f"build {build.pk} is of {build.model.name}, not {model.name}")
    if build.status != BuildStatus.SUCCEEDED:
        fail("engine_build", f"build {build.pk} is {build.status}; only succeeded builds can be served")
    elif build.files_missing:
        fail("engine_build", f"build {build.pk}'s engine on {build.host.name}: {build.files_missing}; build it again")
    if runtime != Runtime.DOCKER:
        fail(
            "engine_build", "engines run in the docker runtime (the host's own tritonserver has no tensorrtllm backend)"
        )
    elif image != build.builder_image:
        fail(
            "engine_build",
            f"build {build.pk} was built in {build.builder_image}; serve it from that image, not {image}",
        )
    else:
        digest = (host.builders or {}).get("images", {}).get(image, "")
        if (host.builders or {}).get("docker_error"):
            fail("engine_build", f"{host.name} could not read its images: {host.builders['docker_error']}")
        elif digest != build.image_digest:
            fail(
                "engine_build",
                f"{image} on {host.name} is {digest or 'not present'}, but build {build.pk} was made in "
                f"{build.image_digest} (TensorRT-LLM {build.trtllm_version}): an engine only loads in its own image",
            )
    gpus = {gpu.index: gpu for gpu in host.gpus.all()}
    chosen = tuple(sorted(spec.gpu_ids)) or tuple(sorted(gpus)[: build.world_size])
    if len(chosen) != build.world_size:
        fail(
            "gpu_ids",
            f"build {build.pk} is tp {build.tp_size} x pp {build.pp_size} = {build.world_size} GPUs; "
            f"it is given {len(chosen)}",
        )
    for index in chosen:
        gpu = gpus.get(index)
        if gpu is not None and gpu.compute_capability != build.compute_capability:
            fail(
                "gpu_ids",
                f"build {build.pk} was built for SM {build.compute_capability} ({build.gpu_name}); "
                f"GPU {index} is {gpu.name} with SM {gpu.compute_capability}",
            )
    built_batch = int(build.spec.get("max_batch_size", 0))
    if spec.max_batch_size > built_batch:
        fail("max_batch_size", f"build {build.pk} was built for at most {built_batch}")
    _check_engine_runtime(spec, build, fail)
    tokens = None
    memory = min((gpus[i].memory_total_bytes for i in chosen if i in gpus), default=0)
    if memory and build.status == BuildStatus.SUCCEEDED:
        tokens = _kv_budget(spec, model, build, memory, len(chosen), int(build.spec.get("max_seq_len", 1)), fail)
    return Resolved(spec=spec, model=model, build=build, gpus=chosen, kv_cache_tokens=tokens)


def _check_engine_runtime(spec: PlacementSpec, build: EngineBuild, fail: Fail) -> None:
    """The tensorrt_llm model's runtime parameters, against what the build and its
    release's tensorrtllm backend read."""
    release = trtllm.release_for(build.trtllm_version)
    version = build.trtllm_version or "unknown"
    if spec.max_num_sequences is not None:
        fail(
            "max_num_sequences",
            f"the tensorrtllm backend of TensorRT-LLM {version} reads no max_num_sequences: the sequences in "
            f"flight are bounded by the engine's max_batch_size ({build.spec.get('max_batch_size')} for build "
            f"{build.pk}); build with another max_batch_size to change it",
        )
    if spec.max_seq_len is not None:
        fail(
            "max_seq_len",
            f"an engine's max_seq_len is set when it is built ({build.spec.get('max_seq_len')} for build "
            f"{build.pk}); leave it empty",
        )
    if spec.dtype != Dtype.AUTO:
        fail("dtype", f"an engine runs in the dtype it was built with ({build.spec.get('dtype')}); leave it auto")
    if spec.decoding_mode:
        able = release.decoding_modes if release else frozenset()
        if spec.decoding_mode not in able:
            fail("decoding_mode", f"TensorRT-LLM {version}'s tensorrtllm backend does not take {spec.decoding_mode}")
        elif spec.decoding_mode == DecodingMode.BEAM_SEARCH and int(build.spec.get("max_beam_width", 1)) < 2:
            fail("decoding_mode", f"beam_search needs an engine built with max_beam_width above 1 (build {build.pk})")
    if spec.enable_kv_cache_reuse and not build.spec.get("paged_context_fmha", False):
        fail(
            "enable_kv_cache_reuse",
            f"KV-cache reuse needs an engine built with paged context FMHA; build {build.pk} was built without",
        )


def _kv_budget(
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


def _check_transformers(spec: PlacementSpec, model: RegisteredModel, host: GpuHost, fail: Fail) -> Resolved:
    """The path that runs wherever Triton's python backend does: the checkpoint
    through transformers' AutoModelForCausalLM, streamed (decoupled), on a GPU
    within its memory fraction or on the CPU. On a GPU each instance's fraction
    must hold its weights, a KV cache for max_num_sequences sequences of
    max_seq_len tokens and one prefill's activations (deployments.gpu_plan)."""
    if not spec.decoupled:
        fail("decoupled", "the transformers path always streams (a decoupled model): leave decoupled on")
    causal = model.architecture.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
    if not causal and not model.config.get("auto_map"):
        fail(
            "model",
            f"{model.name} is {a(model.architecture or 'model of unknown architecture')}, "
            "not a causal language model transformers can generate with",
        )
    _refuse_engine_only(spec, fail, "the transformers path")
    if spec.max_num_sequences is not None and spec.max_num_sequences < spec.max_batch_size:
        fail("max_num_sequences", f"must be at least max_batch_size ({spec.max_batch_size}): a batch joins at once")
    host_gpus = {gpu.index: gpu for gpu in host.gpus.all()}
    kind, gpus = resolve_instances(spec.instance_kind, spec.gpu_ids, host_gpus)
    _check_precision(spec, kind, gpus, host_gpus, fail)
    limit = model.max_position_embeddings
    if spec.max_seq_len is not None and limit and spec.max_seq_len > limit:
        fail("max_seq_len", f"must be at most {limit}, {model.name}'s max_position_embeddings")
    if kind == InstanceKind.GPU:
        sequences = spec.max_num_sequences or spec.max_batch_size
        length = transformers_max_seq_len(model, spec.max_seq_len)
        try:
            needs = transformers_needs(
                model, max_num_sequences=sequences, max_seq_len=length, element_bytes=_element_bytes(spec, kind)
            )
        except ValueError as exc:
            fail("model", str(exc))
            return Resolved(spec=spec, model=model)
        for index in gpus:
            gpu = host_gpus.get(index)
            if gpu is not None and spec.gpu_memory_fraction * gpu.memory_total_bytes < needs.total:
                fail(
                    "gpu_memory_fraction",
                    f"{spec.gpu_memory_fraction:g} of GPU {index}'s {gpu.memory_total_bytes / 2**30:.0f} GiB cannot "
                    f"hold {model.name}'s {needs.weights / 2**30:.2f} GiB of weights, a KV cache of "
                    f"{needs.kv_cache / 2**30:.2f} GiB for {sequences} sequences of {length} tokens and "
                    f"{needs.activations / 2**30:.2f} GiB of activations ({needs.total / 2**30:.2f} GiB in all)",
                )
    return Resolved(spec=spec, model=model)


def _check_llm_api(
    spec: PlacementSpec, model: RegisteredModel, host: GpuHost, runtime: str, image: str, fail: Fail
) -> Resolved | None:
    """The no-build path: the checkpoint served by the LLM-API backend of an image
    whose TensorRT-LLM release has it, on tensor-parallel GPUs of one model."""
    version = settings.GANTRY_BUILDER_IMAGES.get(image, "")
    release = trtllm.release_for(version)
    if runtime != Runtime.DOCKER:
        fail("llm_api", "the LLM API runs in the docker runtime, in a TensorRT-LLM image")
    elif release is None or not release.llmapi_model_dir:
        able = [
            i for i, v in settings.GANTRY_BUILDER_IMAGES.items() if (r := trtllm.release_for(v)) and r.llmapi_model_dir
        ]
        fail(
            "llm_api",
            f"{image} has no LLM-API backend Gantry knows of (TensorRT-LLM {version or 'unknown'}); "
            f"images that have one: {', '.join(able) or 'none in GANTRY_BUILDER_IMAGES'}",
        )
    if model.architecture not in (release.llmapi_architectures if release else frozenset()):
        first = trtllm.first_release_serving(model.architecture)
        fail(
            "model",
            f"architecture {model.architecture or '(none)'} is not one TensorRT-LLM {version or '(none)'} serves"
            + (f"; TensorRT-LLM {first.version} and later do" if first else ""),
        )
    if spec.decoding_mode:
        fail("decoding_mode", "the LLM API takes sampling per request; decoding_mode is the tensorrtllm backend's")
    if spec.dtype != Dtype.AUTO:
        fail("dtype", "the LLM API loads the checkpoint in its own dtype; leave it auto")
    limit = model.max_position_embeddings
    if spec.max_seq_len is not None and limit and spec.max_seq_len > limit:
        fail("max_seq_len", f"must be at most {limit}, {model.name}'s max_position_embeddings")
    gpus = {gpu.index: gpu for gpu in host.gpus.all()}
    chosen = tuple(sorted(spec.gpu_ids)) or tuple(sorted(gpus)[:1])
    if not chosen or any(i not in gpus for i in chosen):
        fail("gpu_ids", f"the LLM API needs GPUs of {host.name}: it has {sorted(gpus) or 'none'}")
        return None
    if model.num_attention_heads and model.num_attention_heads % len(chosen):
        fail("gpu_ids", f"{len(chosen)} GPUs (tensor parallel) must divide {model.num_attention_heads} attention heads")
    memory = min(gpus[i].memory_total_bytes for i in chosen)
    sequence = min(spec.max_seq_len or model.max_position_embeddings or 2048, 2048)
    tokens = _kv_budget(spec, model, None, memory, len(chosen), sequence, fail)
    return Resolved(spec=spec, model=model, gpus=chosen, kv_cache_tokens=tokens)


def _check_sentence_model(spec: PlacementSpec, model: RegisteredModel, host: GpuHost, fail: Fail) -> None:
    """An embedder or reranker on the python backend: its precision, its input
    length (up to the checkpoint's positions), and weights its fraction can hold."""
    if spec.engine_build is not None:
        fail("engine_build", f"{model.name} is {a(model.kind)} model, not an llm")
    if spec.llm_api:
        fail("llm_api", f"{model.name} is {a(model.kind)} model, not an llm")
    _refuse_engine_only(spec, fail, f"{a(model.kind)} model")
    if spec.max_num_sequences is not None:
        fail("max_num_sequences", f"{a(model.kind)} model generates no sequences: max_batch_size bounds a batch")
    host_gpus = {gpu.index: gpu for gpu in host.gpus.all()}
    kind, gpus = resolve_instances(spec.instance_kind, spec.gpu_ids, host_gpus)
    _check_precision(spec, kind, gpus, host_gpus, fail)
    limit = model.max_position_embeddings
    if spec.max_seq_len is not None and limit and spec.max_seq_len > limit:
        fail("max_seq_len", f"must be at most {limit}, {model.name}'s max_position_embeddings")
    if kind == InstanceKind.GPU:
        weights = (model.parameter_count or model.size_bytes // 4) * _element_bytes(spec, kind)
        for index in gpus:
            gpu = host_gpus.get(index)
            if gpu is not None and spec.gpu_memory_fraction * gpu.memory_total_bytes < weights * 1.2:
                fail(
                    "gpu_memory_fraction",
                    f"{spec.gpu_memory_fraction:g} of GPU {index}'s {gpu.memory_total_bytes / 2**30:.0f} GiB cannot "
                    f"hold {model.name}'s {weights / 2**30:.2f} GiB of weights and room for a batch",
                )


def _refuse_engine_only(spec: PlacementSpec, fail: Fail, what: str) -> None:
    """Settings only an engine or the LLM API reads, refused by name elsewhere."""
    if spec.kv_cache_free_gpu_mem_fraction is not None:
        fail("kv_cache_free_gpu_mem_fraction", f"TensorRT-LLM's KV-cache share; {what} has none to set")
    if spec.max_tokens_in_paged_kv_cache is not None:
        fail("max_tokens_in_paged_kv_cache", f"TensorRT-LLM's paged KV cache; {what} has none")
    if spec.enable_kv_cache_reuse:
        fail("enable_kv_cache_reuse", f"TensorRT-LLM's KV-cache reuse; {what} cannot reuse a cache")
    if spec.decoding_mode:
        fail("decoding_mode", f"the tensorrtllm backend's decoding mode; {what} samples per request")


def _check_precision(
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


def _element_bytes(spec: PlacementSpec, kind: str) -> int:
    """Bytes per weight as the model will load: auto is 16-bit on a GPU, fp32 on a CPU."""
    if spec.dtype == Dtype.AUTO:
        return 2 if kind == InstanceKind.GPU else 4
    return dtype_bytes(spec.dtype)


def placements_validate(*, host: GpuHost, specs: list[PlacementSpec], runtime: str, image: str) -> list[Resolved]:
    """Check a deployment's placements against each other and the host: known,
    inspected, servable models; unique names; batching and priority rules;
    GPUs the host has; the engine gates; its own GPU plan within the headroom.
    ValidationFailed names every broken rule by field (``models[i].field``)."""
    resolved, errors = placements_check(host=host, specs=specs, runtime=runtime, image=image)
    if errors:
        raise ValidationFailed(errors)
    return resolved


def placements_check(
    *, host: GpuHost, specs: list[PlacementSpec], runtime: str, image: str
) -> tuple[list[Resolved], dict[str, list[str]]]:
    """placements_validate's rules without raising: the placements that resolved
    (a plan can be drawn from them) and every broken rule by field."""
    if not specs:
        return [], {"models": ["a deployment needs at least one model"]}
    errors: dict[str, list[str]] = {}
    resolved = []
    names: set[str] = set()
    gpu_indexes = set(host.gpus.values_list("index", flat=True))
    for i, spec in enumerate(specs):
        where = f"models[{i}]"

        def fail(field: str, message: str, where: str = where) -> None:
            errors.setdefault(f"{where}.{field}", []).append(message)

        model = RegisteredModel.objects.filter(name=spec.model).first()
        if model is None:
            fail("model", f"no registered model named {spec.model!r}")
            continue
        if model.kind not in SERVABLE_KINDS:
            fail("model", f"{model.name} is {a(model.kind)} model; this version deploys "
                          f"{', '.join(SERVABLE_KINDS)} models only")  # fmt: skip
        if model.inspection != Inspection.READY:
            fail("model", f"{model.name} is not inspected yet ({model.inspection}) {model.inspection_message}".rstrip())
        triton_name = spec.triton_name or model.name
        if triton_name in names:
            fail("triton_name", f"{triton_name!r} is used twice in this deployment")
        names.add(triton_name)
        _check_queue(spec, fail)
        if spec.instance_kind == InstanceKind.GPU and not gpu_indexes:
            fail("instance_kind", f"{host.name} has no GPUs")
        unknown = sorted(set(spec.gpu_ids) - gpu_indexes)
        if unknown:
            fail("gpu_ids", f"{host.name} has no GPU with index {unknown}")
        if model.kind == ModelKind.LLM:
            engine = _check_llm(spec, model, host, runtime, image, fail)
            if engine is not None:
                resolved.append(engine)
            continue
        _check_sentence_model(spec, model, host, fail)
        resolved.append(Resolved(spec=spec, model=model))
    if sum(1 for spec in specs if spec.llm_api) > 1:
        errors.setdefault("models", []).append("a deployment serves at most one model through the LLM API")
    rows = placement_rows(resolved)
    _check_llm_api_gpus(specs, resolved, rows, sorted(gpu_indexes), errors)
    if not gpu_indexes:
        _check_auto_on_no_gpus(host, rows, errors)
    own = host_plan(host, [Holder(key=None, name="this deployment", placements=rows)])
    errors.setdefault("models", []).extend(plan_problems(own, own=None))
    if not errors["models"]:
        del errors["models"]
    return resolved, errors


def _check_llm_api_gpus(
    specs: list[PlacementSpec],
    resolved: list[Resolved],
    rows: list[DeploymentModel],
    host_gpus: list[int],
    errors: dict[str, list[str]],
) -> None:
    """TensorRT-LLM's LLM() takes no device ids: its ranks take the first GPUs
    the container sees, and Docker numbers the container's GPUs from 0 in host
    order. So an LLM-API model must hold the lowest of the deployment's GPUs."""
    used = sorted({g for row in rows for g in placement_gpus(row, host_gpus)})
    for item, row in zip(resolved, rows, strict=True):
        if row.backend != Backend.LLM_API:
            continue
        mine = sorted(placement_gpus(row, host_gpus))
        first = used[: len(mine)]
        if mine != first:
            index = next(i for i, spec in enumerate(specs) if spec is item.spec)
            errors.setdefault(f"models[{index}].gpu_ids", []).append(
                f"the LLM API runs on the first {len(mine)} GPU(s) its container sees, here {first} "
                f"(TensorRT-LLM's LLM() takes no device ids): place it on {first}, or the other models on higher GPUs"
            )


def _check_auto_on_no_gpus(host: GpuHost, rows: list[DeploymentModel], errors: dict[str, list[str]]) -> None:
    """Placements of instance kind auto run on the CPU of a host that reports no
    GPUs, and on its first GPU as soon as it reports one (a driver installed, NVML
    back): their fractions must fit that GPU too."""
    auto = [row for row in rows if row.instance_kind == InstanceKind.AUTO]
    total = sum(row.gpu_memory_fraction for row in auto)
    if total > 1.0 + 1e-9:
        errors.setdefault("models", []).append(
            f"{', '.join(row.triton_name for row in auto)} have instance_kind auto: they run on {host.name}'s first "
            f"GPU once it reports one, and their gpu_memory_fraction add up to {total:g} > 1; lower them, or set "
            "instance_kind KIND_CPU"
        )


def _check_queue(spec: PlacementSpec, fail: Fail) -> None:
    """Triton's dynamic batcher: priorities, preferred sizes and the queue policy."""
    if spec.priority_levels and not 1 <= spec.default_priority_level <= spec.priority_levels:
        fail("default_priority_level", f"must be between 1 and priority_levels ({spec.priority_levels})")
    if not spec.priority_levels and spec.default_priority_level:
        fail("default_priority_level", "needs priority_levels")
    if spec.preferred_batch_sizes and max(spec.preferred_batch_sizes) > spec.max_batch_size:
        fail("preferred_batch_sizes", "must not exceed max_batch_size")
    if spec.timeout_action == TimeoutAction.DELAY and not spec.queue_timeout_us:
        fail("timeout_action", "DELAY acts on requests past queue_timeout_us: set a queue timeout too")


def placements_write(*, deployment: Deployment, resolved: list[Resolved]) -> None:
    """Replace the deployment's placement rows with ``resolved``."""
    deployment.placements.all().delete()
    for row in placement_rows(resolved, deployment=deployment):
        row.save()


# The spec fields a placement row stores as they are (the rest are derived).
_STORED = tuple(
    name
    for name in PLACEMENT_FIELDS
    if name not in ("model", "triton_name", "engine_build", "llm_api", "gpu_ids", "instance_kind")
)


def placement_rows(resolved: list[Resolved], *, deployment: Deployment | None = None) -> list[DeploymentModel]:
    """The (unsaved) placement rows ``resolved`` becomes: what placements_write
    stores, and what a plan is drawn from before anything is stored."""
    rows = []
    for item in resolved:
        spec, model = item.spec, item.model
        engine = item.build is not None or spec.llm_api
        values = {name: getattr(spec, name) for name in _STORED}
        values["preferred_batch_sizes"] = list(spec.preferred_batch_sizes)
        rows.append(
            DeploymentModel(
                **({"deployment": deployment} if deployment is not None else {}),
                **values,
                triton_name=spec.triton_name or model.name,
                registered_model=model,
                engine_build=item.build,
                backend=_backend(item),
                # An engine's GPUs are its own (gpu_device_ids); for the plan they count as a GPU placement.
                instance_kind=InstanceKind.GPU if engine else spec.instance_kind,
                gpu_ids=list(item.gpus) if engine else list(spec.gpu_ids),
                kv_cache_tokens=item.kv_cache_tokens,
            )
        )
    return rows


def _backend(item: Resolved) -> str:
    """An llm is served from its engine build, through the LLM API, or by transformers."""
    if item.model.kind != ModelKind.LLM:
        return SERVABLE_KINDS[item.model.kind]
    if item.build is not None:
        return Backend.TENSORRTLLM
    return Backend.LLM_API if item.spec.llm_api else Backend.TRANSFORMERS


def placements_snapshot(deployment: Deployment) -> list[dict[str, Any]]:
    """The deployment's placements as PlacementSpec fields (and the KV-cache
    tokens planned), for revisions and comparisons."""
    return [
        {
            **{name: getattr(p, name) for name in _STORED},
            "model": p.registered_model.name,
            "triton_name": p.triton_name,
            "preferred_batch_sizes": list(p.preferred_batch_sizes),
            "instance_kind": p.instance_kind,
            "gpu_ids": list(p.gpu_ids),
            "engine_build": p.engine_build_id,
            "llm_api": p.backend == Backend.LLM_API,
            "kv_cache_tokens": p.kv_cache_tokens,
        }
        for p in deployment.placements.select_related("registered_model").order_by("triton_name")
    ]


def placement_from_snapshot(item: dict[str, Any]) -> Resolved:
    """A placement as a revision recorded it (validated when it was made)."""
    spec = spec_from_snapshot(item)
    build = EngineBuild.objects.filter(pk=spec.engine_build).first() if spec.engine_build else None
    return Resolved(
        spec=spec,
        model=RegisteredModel.objects.get(name=spec.model),
        build=build,
        gpus=spec.gpu_ids if (build or spec.llm_api) else (),
        kv_cache_tokens=item.get("kv_cache_tokens"),
    )


def spec_from_snapshot(item: dict[str, Any]) -> PlacementSpec:
    """The spec a revision recorded; fields it predates take their defaults."""
    return PlacementSpec.from_fields({k: v for k, v in item.items() if k in PLACEMENT_FIELDS})
