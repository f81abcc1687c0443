"""Model placements: what one model of a deployment asks of its host (batching,
instances, GPUs and memory, and for an llm the engine or LLM-API path), the
rules a set of placements must pass before anything is written, and their
snapshots in revisions.

A placement's fields, defaults and bounds are defined once, on
``DeploymentModel``; ``PlacementSpec`` takes its defaults from there and the
API serializer and the browser form derive their fields from it.

Just over 400 lines on purpose: the rules of the three LLM paths (engine, LLM
API, transformers) sit beside the rules they share with every placement.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from django.conf import settings
from django.core.validators import MaxValueValidator

from deployments import trtllm
from deployments.errors import ValidationFailed
from deployments.models import (
    Backend,
    BuildStatus,
    Deployment,
    DeploymentModel,
    EngineBuild,
    GpuHost,
    Inspection,
    InstanceKind,
    ModelKind,
    RegisteredModel,
    Runtime,
)
from deployments.placement import engine_bytes_per_gpu, kv_cache_tokens, resolve_instances

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
    instance_count: int = _default("instance_count")
    instance_kind: str = _default("instance_kind")
    gpu_ids: tuple[int, ...] = ()
    gpu_memory_fraction: float = _default("gpu_memory_fraction")
    # llm models: the engine build to serve, and how the backend schedules it.
    engine_build: int | None = None
    llm_api: bool = False  # serve the checkpoint itself through the LLM API (no engine build)
    batch_scheduler_policy: str = _default("batch_scheduler_policy")
    decoupled: bool = _default("decoupled")

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
    """A validated placement: its spec, model, and for an engine the build, GPUs and KV-cache tokens."""

    spec: PlacementSpec
    model: RegisteredModel
    build: EngineBuild | None = None
    gpus: tuple[int, ...] = ()
    kv_cache_tokens: int | None = None


def _check_llm(
    spec: PlacementSpec, model: RegisteredModel, host: GpuHost, runtime: str, image: str, fail: Any
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
        if digest != build.image_digest:
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
    tokens = None
    memory = min((gpus[i].memory_total_bytes for i in chosen if i in gpus), default=0)
    if memory and build.status == BuildStatus.SUCCEEDED:
        try:
            tokens = kv_cache_tokens(
                model=model, build=build, fraction=spec.gpu_memory_fraction, gpu_memory_bytes=memory
            )
        except ValueError as exc:
            fail("model", str(exc))
        else:
            per_gpu = engine_bytes_per_gpu(build)
            if tokens < int(build.spec.get("max_seq_len", 1)):
                fail(
                    "gpu_memory_fraction",
                    f"{spec.gpu_memory_fraction:g} of {memory / 2**30:.0f} GiB leaves room for {max(tokens, 0)} "
                    f"KV-cache tokens after the engine's {per_gpu / 2**30:.1f} GiB per GPU: not even one "
                    f"{build.spec.get('max_seq_len')}-token sequence",
                )
    return Resolved(spec=spec, model=model, build=build, gpus=chosen, kv_cache_tokens=tokens)


def _check_transformers(spec: PlacementSpec, model: RegisteredModel, host: GpuHost, fail: Any) -> Resolved:
    """The path that runs wherever Triton's python backend does: the checkpoint
    through transformers' AutoModelForCausalLM, streamed (decoupled), on a GPU
    within its memory fraction or on the CPU."""
    if not spec.decoupled:
        fail("decoupled", "the transformers path always streams (a decoupled model): leave decoupled on")
    causal = model.architecture.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
    if not causal and not model.config.get("auto_map"):
        fail(
            "model",
            f"{model.name} is a {model.architecture or 'model of unknown architecture'}, "
            "not a causal language model transformers can generate with",
        )
    host_gpus = {gpu.index: gpu for gpu in host.gpus.all()}
    kind, gpus = resolve_instances(spec.instance_kind, spec.gpu_ids, host_gpus)
    if kind == InstanceKind.GPU:
        weights = 2 * (model.parameter_count or model.size_bytes // 2)  # 16-bit weights on a GPU
        for index in gpus:
            gpu = host_gpus.get(index)
            if gpu is not None and spec.gpu_memory_fraction * gpu.memory_total_bytes < weights * 1.2:
                fail(
                    "gpu_memory_fraction",
                    f"{spec.gpu_memory_fraction:g} of GPU {index}'s {gpu.memory_total_bytes / 2**30:.0f} GiB cannot "
                    f"hold {model.name}'s {weights / 2**30:.2f} GiB of 16-bit weights and room to generate",
                )
    return Resolved(spec=spec, model=model)


def _check_llm_api(
    spec: PlacementSpec, model: RegisteredModel, host: GpuHost, runtime: str, image: str, fail: Any
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
    if model.architecture not in (release.model_dirs if release else {}):
        fail("model", f"architecture {model.architecture or '(none)'} is not one TensorRT-LLM {version} serves")
    gpus = {gpu.index: gpu for gpu in host.gpus.all()}
    chosen = tuple(sorted(spec.gpu_ids)) or tuple(sorted(gpus)[:1])
    if not chosen or any(i not in gpus for i in chosen):
        fail("gpu_ids", f"the LLM API needs GPUs of {host.name}: it has {sorted(gpus) or 'none'}")
        return None
    if model.num_attention_heads and model.num_attention_heads % len(chosen):
        fail("gpu_ids", f"{len(chosen)} GPUs (tensor parallel) must divide {model.num_attention_heads} attention heads")
    memory = min(gpus[i].memory_total_bytes for i in chosen)
    tokens = None
    try:
        tokens = kv_cache_tokens(
            model=model, build=None, fraction=spec.gpu_memory_fraction, gpu_memory_bytes=memory, tp_size=len(chosen)
        )
    except ValueError as exc:
        fail("model", str(exc))
    else:
        limit = model.max_position_embeddings or 1
        if tokens < min(limit, 2048):
            fail(
                "gpu_memory_fraction",
                f"{spec.gpu_memory_fraction:g} of {memory / 2**30:.0f} GiB leaves room for {max(tokens, 0)} "
                f"KV-cache tokens after the {model.size_bytes / len(chosen) / 2**30:.1f} GiB of weights per GPU",
            )
    return Resolved(spec=spec, model=model, gpus=chosen, kv_cache_tokens=tokens)


def placements_validate(*, host: GpuHost, specs: list[PlacementSpec], runtime: str, image: str) -> list[Resolved]:
    """Check a deployment's placements against each other and the host: known,
    inspected, servable models; unique names; batching and priority rules;
    GPUs the host has; the engine gates; per-GPU fractions within the headroom.
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
    per_gpu_fraction: dict[int, float] = {}
    for i, spec in enumerate(specs):
        where = f"models[{i}]"
        model = RegisteredModel.objects.filter(name=spec.model).first()
        if model is None:
            errors.setdefault(f"{where}.model", []).append(f"no registered model named {spec.model!r}")
            continue
        if model.kind not in SERVABLE_KINDS:
            errors.setdefault(f"{where}.model", []).append(
                f"{model.name} is a {model.kind} model; this version deploys {', '.join(SERVABLE_KINDS)} models only"
            )
        if model.inspection != Inspection.READY:
            errors.setdefault(f"{where}.model", []).append(
                f"{model.name} is not inspected yet ({model.inspection}) {model.inspection_message}".rstrip()
            )
        triton_name = spec.triton_name or model.name
        if triton_name in names:
            errors.setdefault(f"{where}.triton_name", []).append(f"{triton_name!r} is used twice in this deployment")
        names.add(triton_name)
        if spec.priority_levels and not 1 <= spec.default_priority_level <= spec.priority_levels:
            errors.setdefault(f"{where}.default_priority_level", []).append(
                f"must be between 1 and priority_levels ({spec.priority_levels})"
            )
        if not spec.priority_levels and spec.default_priority_level:
            errors.setdefault(f"{where}.default_priority_level", []).append("needs priority_levels")
        if spec.preferred_batch_sizes and max(spec.preferred_batch_sizes) > spec.max_batch_size:
            errors.setdefault(f"{where}.preferred_batch_sizes", []).append("must not exceed max_batch_size")
        if spec.instance_kind == InstanceKind.GPU and not gpu_indexes:
            errors.setdefault(f"{where}.instance_kind", []).append(f"{host.name} has no GPUs")
        unknown = sorted(set(spec.gpu_ids) - gpu_indexes)
        if unknown:
            errors.setdefault(f"{where}.gpu_ids", []).append(f"{host.name} has no GPU with index {unknown}")
        if model.kind == ModelKind.LLM:
            engine = _check_llm(
                spec, model, host, runtime, image,
                lambda field, message, where=where: errors.setdefault(f"{where}.{field}", []).append(message),
            )  # fmt: skip
            if engine is None:
                continue
            on_gpus = engine.gpus if (engine.build or spec.llm_api) else _instance_gpus(spec, gpu_indexes)
            for gpu in on_gpus:
                per_gpu_fraction[gpu] = per_gpu_fraction.get(gpu, 0.0) + spec.gpu_memory_fraction
            resolved.append(engine)
            continue
        if spec.engine_build is not None:
            errors.setdefault(f"{where}.engine_build", []).append(f"{model.name} is a {model.kind} model, not an llm")
        for gpu in _instance_gpus(spec, gpu_indexes):
            per_gpu_fraction[gpu] = per_gpu_fraction.get(gpu, 0.0) + spec.gpu_memory_fraction
        resolved.append(Resolved(spec=spec, model=model))
    if sum(1 for spec in specs if spec.llm_api) > 1:
        errors.setdefault("models", []).append("a deployment serves at most one model through the LLM API")
    headroom = settings.GANTRY_GPU_MEMORY_HEADROOM
    for gpu, total in sorted(per_gpu_fraction.items()):
        if total > headroom + 1e-9:
            errors.setdefault("models", []).append(
                f"GPU {gpu}: memory fractions add up to {total:.2f}, above the headroom limit {headroom:.2f}"
            )
    return resolved, errors


def _instance_gpus(spec: PlacementSpec, host_gpus: set[int]) -> tuple[int, ...]:
    """The GPUs a python-backend placement's instances use (none on the CPU)."""
    return resolve_instances(spec.instance_kind, spec.gpu_ids, host_gpus)[1]


def placements_write(*, deployment: Deployment, resolved: list[Resolved]) -> None:
    """Replace the deployment's placement rows with ``resolved``."""
    deployment.placements.all().delete()
    for row in placement_rows(resolved, deployment=deployment):
        row.save()


def placement_rows(resolved: list[Resolved], *, deployment: Deployment | None = None) -> list[DeploymentModel]:
    """The (unsaved) placement rows ``resolved`` becomes: what placements_write
    stores, and what a plan is drawn from before anything is stored."""
    rows = []
    for item in resolved:
        spec, model = item.spec, item.model
        engine = item.build is not None or spec.llm_api
        rows.append(
            DeploymentModel(
                **({"deployment": deployment} if deployment is not None else {}),
                triton_name=spec.triton_name or model.name,
                registered_model=model,
                engine_build=item.build,
                backend=_backend(item),
                max_batch_size=spec.max_batch_size,
                preferred_batch_sizes=list(spec.preferred_batch_sizes),
                max_queue_delay_us=spec.max_queue_delay_us,
                priority_levels=spec.priority_levels,
                default_priority_level=spec.default_priority_level,
                queue_timeout_us=spec.queue_timeout_us,
                max_queue_size=spec.max_queue_size,
                instance_count=spec.instance_count,
                # An engine's GPUs are its own (gpu_device_ids); for the plan they count as a GPU placement.
                instance_kind=InstanceKind.GPU if engine else spec.instance_kind,
                gpu_ids=list(item.gpus) if engine else list(spec.gpu_ids),
                gpu_memory_fraction=spec.gpu_memory_fraction,
                batch_scheduler_policy=spec.batch_scheduler_policy,
                decoupled=spec.decoupled,
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
    """The deployment's placements as PlacementSpec fields, for revisions and comparisons."""
    return [
        {
            "model": p.registered_model.name,
            "triton_name": p.triton_name,
            "max_batch_size": p.max_batch_size,
            "preferred_batch_sizes": list(p.preferred_batch_sizes),
            "max_queue_delay_us": p.max_queue_delay_us,
            "priority_levels": p.priority_levels,
            "default_priority_level": p.default_priority_level,
            "queue_timeout_us": p.queue_timeout_us,
            "max_queue_size": p.max_queue_size,
            "instance_count": p.instance_count,
            "instance_kind": p.instance_kind,
            "gpu_ids": list(p.gpu_ids),
            "gpu_memory_fraction": p.gpu_memory_fraction,
            "engine_build": p.engine_build_id,
            "llm_api": p.backend == Backend.LLM_API,
            "batch_scheduler_policy": p.batch_scheduler_policy,
            "decoupled": p.decoupled,
            "kv_cache_tokens": p.kv_cache_tokens,
        }
        for p in deployment.placements.select_related("registered_model").order_by("triton_name")
    ]


def placement_from_snapshot(item: dict[str, Any]) -> Resolved:
    """A placement as a revision recorded it (validated when it was made)."""
    spec = PlacementSpec.from_fields({k: v for k, v in item.items() if k != "kv_cache_tokens"})
    build = EngineBuild.objects.filter(pk=spec.engine_build).first() if spec.engine_build else None
    return Resolved(
        spec=spec,
        model=RegisteredModel.objects.get(name=spec.model),
        build=build,
        gpus=spec.gpu_ids if (build or spec.llm_api) else (),
        kv_cache_tokens=item.get("kv_cache_tokens"),
    )
