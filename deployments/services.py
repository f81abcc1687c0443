"""Every write Gantry makes goes through a function here.

Views, API views, consumers and worker tasks are thin doors into these
services. Status changes go through ``deployment_transition``: a conditional
update against the table in deployments.states, an event, and a publish.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.celery import app as celery_app
from deployments import events, states, trtllm
from deployments.checkpoints import CheckpointInfo, inspect_checkpoint, under_roots
from deployments.errors import InvalidTransition, NotFound, ValidationFailed
from deployments.models import (
    Backend,
    BuildLogLine,
    BuildStatus,
    Deployment,
    DeploymentModel,
    DeploymentRevision,
    DeploymentStatus,
    DesiredState,
    EngineBuild,
    Gpu,
    GpuHost,
    Inspection,
    InstanceKind,
    LogLine,
    MetricSample,
    ModelKind,
    RegisteredModel,
    RevisionStatus,
    Runtime,
    SchedulerPolicy,
)
from deployments.permissions import require_operator
from deployments.placement import engine_bytes_per_gpu, kv_cache_tokens, resolve_instances

log = logging.getLogger(__name__)

# Kinds this version can place in a deployment, and the backend each uses.
SERVABLE_KINDS = {
    ModelKind.EMBEDDING: Backend.PYTHON,
    ModelKind.RERANKER: Backend.PYTHON,
    ModelKind.LLM: Backend.TENSORRTLLM,
}
# Kinds whose clients send text, so the checkpoint must carry its tokenizer.
NEEDS_TOKENIZER = frozenset({ModelKind.EMBEDDING, ModelKind.RERANKER, ModelKind.LLM})


# --- hosts -------------------------------------------------------------------


@dataclass(frozen=True)
class GpuReport:
    index: int
    uuid: str
    name: str
    compute_capability: str
    memory_total_bytes: int
    memory_used_bytes: int = 0
    utilization_percent: int = 0


def host_heartbeat(
    *,
    name: str,
    address: str = "",
    driver_version: str = "",
    cuda_version: str = "",
    nvml_error: str = "",
    agent_version: str = "",
    gpus: list[GpuReport],
    builders: dict[str, Any] | None = None,
) -> GpuHost:
    """Record a host agent's beat, its GPU inventory and what it can build with;
    register the host on first beat."""
    now = timezone.now()
    with transaction.atomic():
        host, created = GpuHost.objects.select_for_update().get_or_create(
            name=name, defaults={"address": address or "127.0.0.1"}
        )
        came_back = host.offline_since is not None
        host.address = address or host.address
        host.driver_version = driver_version
        host.cuda_version = cuda_version
        host.nvml_error = nvml_error[:255]
        host.agent_version = agent_version
        if builders is not None:
            host.builders = builders
        host.last_heartbeat = now
        host.offline_since = None
        host.save()
        seen = set()
        for gpu in gpus:
            seen.add(gpu.index)
            # A GPU swapped into the same slot keeps the slot's row but gets the new uuid.
            Gpu.objects.filter(uuid=gpu.uuid).exclude(host=host, index=gpu.index).delete()
            Gpu.objects.update_or_create(
                host=host,
                index=gpu.index,
                defaults={
                    "uuid": gpu.uuid,
                    "name": gpu.name,
                    "compute_capability": gpu.compute_capability,
                    "memory_total_bytes": gpu.memory_total_bytes,
                    "memory_used_bytes": gpu.memory_used_bytes,
                    "utilization_percent": gpu.utilization_percent,
                },
            )
        host.gpus.exclude(index__in=seen).delete()
        if created or came_back:
            events.record(
                kind="host.registered" if created else "host.online",
                source=f"worker:{name}",
                host=host,
                message=f"{name} {'registered' if created else 'back online'} with {len(gpus)} GPU(s)",
                data={"gpus": [g.name for g in gpus], "driver": driver_version, "cuda": cuda_version},
            )
    return host


def hosts_sweep() -> list[str]:
    """Mark hosts that missed GANTRY_HOST_OFFLINE_AFTER_BEATS beats offline, once each.

    Nothing is torn down: their deployments' status is simply no longer
    known, and the host's next beat brings it back.
    """
    allowed = settings.GANTRY_HEARTBEAT_INTERVAL * settings.GANTRY_HOST_OFFLINE_AFTER_BEATS
    threshold = timezone.now() - timedelta(seconds=allowed)
    marked = []
    for host in GpuHost.objects.filter(last_heartbeat__lt=threshold, offline_since=None):
        with transaction.atomic():
            # Compare-and-swap: a beat or another sweep may have got here first.
            changed = GpuHost.objects.filter(pk=host.pk, offline_since=None, last_heartbeat=host.last_heartbeat).update(
                offline_since=timezone.now()
            )
            if not changed:
                continue
            events.record(
                kind="host.offline",
                source="system",
                host=host,
                message=f"{host.name} missed {settings.GANTRY_HOST_OFFLINE_AFTER_BEATS} heartbeats "
                f"(last at {host.last_heartbeat:%H:%M:%S}); its deployments' state is unknown",
            )
            marked.append(host.name)
    return marked


# --- registered models -------------------------------------------------------


def model_register(
    *,
    name: str,
    kind: str,
    path: str,
    host: str,
    hub_id: str = "",
    revision: str = "",
    user: Any = None,
) -> RegisteredModel:
    """Register a HuggingFace-format checkpoint folder on ``host``. The row is
    created at once (inspection pending) and the host inspects the folder
    (workers.tasks.inspect_model), filling in what it found or why it failed."""
    require_operator(user)
    errors: dict[str, str] = {}
    if kind not in ModelKind.values:
        errors["kind"] = f"must be one of {', '.join(ModelKind.values)}"
    if RegisteredModel.objects.filter(name=name).exists():
        errors["name"] = f"a model named {name!r} is already registered"
    target = GpuHost.objects.filter(name=host).first()
    if target is None:
        errors["host"] = f"no GPU host named {host!r}"
    checkpoint = Path(path)
    if not checkpoint.is_absolute():
        errors["path"] = "must be an absolute path"
    elif not under_roots(checkpoint, settings.GANTRY_MODEL_ROOTS):
        allowed = ", ".join(str(r) for r in settings.GANTRY_MODEL_ROOTS)
        errors["path"] = f"must be under one of the configured model roots ({allowed})"
    if errors:
        raise ValidationFailed(errors)
    try:
        with transaction.atomic():
            model = RegisteredModel.objects.create(
                name=name,
                kind=kind,
                host=target,
                path=str(checkpoint),
                hub_id=hub_id,
                revision=revision,
                inspection=Inspection.PENDING,
                created_by=events.signed_in(user),
            )
            events.record(
                kind="model.registered",
                source=events.source_of(user),
                actor=user,
                model=model,
                host=target,
                message=f"registered {name} at {path} on {host}; the host is inspecting it",
            )
            queue = target.queue
            transaction.on_commit(
                lambda: celery_app.send_task("workers.tasks.inspect_model", args=[model.pk], queue=queue)
            )
    except IntegrityError as exc:
        raise ValidationFailed({"name": f"a model named {name!r} is already registered"}) from exc
    return model


def model_inspect(*, model_id: int, source: str) -> None:
    """Read a registered checkpoint on the host that holds it (run there by its
    worker) and record what was found, or why it could not be read."""
    model = RegisteredModel.objects.filter(pk=model_id).first()
    if model is None:
        return
    info: CheckpointInfo | None = None
    error = ""
    try:
        info = inspect_checkpoint(Path(model.path), roots=settings.GANTRY_MODEL_ROOTS)
    except ValidationFailed as exc:
        error = " ".join(msg for msgs in exc.errors.values() for msg in msgs)
    if info is not None and model.kind in NEEDS_TOKENIZER and not info.tokenizer_files:
        error = f"a {model.kind} model needs its tokenizer files beside config.json"
    with transaction.atomic():
        if error:
            RegisteredModel.objects.filter(pk=model_id).update(inspection=Inspection.FAILED, inspection_message=error)
            events.record(kind="model.inspection_failed", source=source, model=model, message=error)
            return
        RegisteredModel.objects.filter(pk=model_id).update(
            inspection=Inspection.READY,
            inspection_message="",
            path=str(Path(model.path).resolve()),
            architecture=info.architecture,
            model_type=info.model_type,
            parameter_count=info.parameter_count,
            hidden_size=info.hidden_size,
            num_layers=info.num_layers,
            num_attention_heads=info.num_attention_heads,
            num_kv_heads=info.num_kv_heads,
            head_dim=info.head_dim,
            vocab_size=info.vocab_size,
            max_position_embeddings=info.max_position_embeddings,
            torch_dtype=info.torch_dtype,
            size_bytes=info.size_bytes,
            tokenizer_files=info.tokenizer_files,
            fingerprint=info.fingerprint,
            config=info.config,
        )
        params = f", {info.parameter_count / 1e6:.0f}M parameters" if info.parameter_count else ""
        events.record(
            kind="model.inspected",
            source=source,
            model=model,
            message=f"{model.name}: {info.architecture or info.model_type}{params}, "
            f"{info.size_bytes / 1e6:.0f} MB, fingerprint {info.fingerprint[:12]}",
        )


# --- deployments -------------------------------------------------------------


@dataclass(frozen=True)
class PlacementSpec:
    model: str
    triton_name: str = ""
    max_batch_size: int = 32
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 2000
    priority_levels: int = 0
    default_priority_level: int = 0
    queue_timeout_us: int = 0
    max_queue_size: int = 0
    instance_count: int = 1
    instance_kind: str = InstanceKind.AUTO
    gpu_ids: tuple[int, ...] = ()
    gpu_memory_fraction: float = 0.1
    # llm models: the engine build to serve, and how the backend schedules it.
    engine_build: int | None = None
    llm_api: bool = False  # serve the checkpoint itself through the LLM API (no engine build)
    batch_scheduler_policy: str = SchedulerPolicy.GUARANTEED_NO_EVICT
    decoupled: bool = True


@dataclass(frozen=True)
class Resolved:
    """A validated placement: its spec, model, and for an engine the build, GPUs and KV-cache tokens."""

    spec: PlacementSpec
    model: RegisteredModel
    build: EngineBuild | None = None
    gpus: tuple[int, ...] = ()
    kv_cache_tokens: int | None = None


def _check_engine(
    spec: PlacementSpec, model: RegisteredModel, host: GpuHost, runtime: str, image: str, fail: Any
) -> Resolved | None:
    """The gates an engine passes before it is placed: built and verified, in the
    image it will run in (same digest, same TensorRT-LLM), for this GPU's SM,
    on exactly tp*pp GPUs, with a batch size it was built for, and a memory
    fraction that holds its weights and leaves room for a KV cache."""
    if spec.engine_build is None and spec.llm_api:
        return _check_llm_api(spec, model, host, runtime, image, fail)
    if spec.engine_build is None:
        fail("engine_build", f"{model.name} is an llm: name the engine build to serve, or set llm_api")
        return None
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


def _allocate_ports(host: GpuHost) -> tuple[int, int, int]:
    """The lowest free triple of ports in the configured range on ``host``."""
    low, high = settings.GANTRY_TRITON_PORT_RANGE
    used: set[int] = set()
    for row in Deployment.objects.filter(host=host).values_list("http_port", "grpc_port", "metrics_port"):
        used.update(row)
    for base in range(low, high - 1, 3):
        triple = (base, base + 1, base + 2)
        if not used.intersection(triple):
            return triple
    raise ValidationFailed({"host": f"no free ports left in GANTRY_TRITON_PORT_RANGE on {host.name}"})


def _validate_placements(host: GpuHost, specs: list[PlacementSpec], *, runtime: str, image: str) -> list[Resolved]:
    if not specs:
        raise ValidationFailed({"models": "a deployment needs at least one model"})
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
            engine = _check_engine(
                spec, model, host, runtime, image,
                lambda field, message, where=where: errors.setdefault(f"{where}.{field}", []).append(message),
            )  # fmt: skip
            if engine is None:
                continue
            for gpu in engine.gpus:
                per_gpu_fraction[gpu] = per_gpu_fraction.get(gpu, 0.0) + spec.gpu_memory_fraction
            resolved.append(engine)
            continue
        if spec.engine_build is not None:
            errors.setdefault(f"{where}.engine_build", []).append(f"{model.name} is a {model.kind} model, not an llm")
        for gpu in resolve_instances(spec.instance_kind, spec.gpu_ids, gpu_indexes)[1]:
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
    if errors:
        raise ValidationFailed(errors)
    return resolved


def deployment_create(
    *,
    name: str,
    host_name: str,
    placements: list[PlacementSpec],
    runtime: str = Runtime.PROCESS,
    image: str = "",
    ports: tuple[int, int, int] | None = None,
    user: Any = None,
) -> Deployment:
    """Create a stopped deployment of one or more models on a host (nothing starts yet)."""
    require_operator(user)
    if Deployment.objects.filter(name=name).exists():
        raise ValidationFailed({"name": f"a deployment named {name!r} already exists"})
    host = GpuHost.objects.filter(name=host_name).first()
    if host is None:
        raise ValidationFailed({"host": f"no GPU host named {host_name!r} has announced itself"})
    if runtime == Runtime.DOCKER and image not in settings.GANTRY_ALLOWED_IMAGES:
        allowed = ", ".join(settings.GANTRY_ALLOWED_IMAGES) or "none are configured (GANTRY_ALLOWED_IMAGES)"
        raise ValidationFailed({"image": f"{image or 'an empty image'} is not allow-listed; allowed: {allowed}"})
    if runtime == Runtime.PROCESS and image:
        raise ValidationFailed({"image": "the process runtime runs the host's own tritonserver; leave image empty"})
    if ports is not None:
        if len(set(ports)) != 3:
            raise ValidationFailed({"ports": "http, grpc and metrics ports must differ"})
        taken = Deployment.objects.filter(host=host).filter(
            Q(http_port__in=ports) | Q(grpc_port__in=ports) | Q(metrics_port__in=ports)
        )
        if taken.exists():
            raise ValidationFailed(
                {"ports": f"one of {list(ports)} is already used by {taken.first().name} on {host.name}"}
            )
    resolved = _validate_placements(host, placements, runtime=runtime, image=image)
    try:
        with transaction.atomic():
            http_port, grpc_port, metrics_port = ports or _allocate_ports(host)
            deployment = Deployment.objects.create(
                name=name,
                host=host,
                runtime=runtime,
                image=image,
                http_port=http_port,
                grpc_port=grpc_port,
                metrics_port=metrics_port,
                created_by=events.signed_in(user),
            )
            _write_placements(deployment, resolved)
            DeploymentRevision.objects.create(
                deployment=deployment,
                generation=1,
                spec=placements_snapshot(deployment),
                created_by=deployment.created_by,
            )
            events.record(
                kind="deployment.created",
                source=events.source_of(user),
                actor=user,
                deployment=deployment,
                to_status=deployment.status,
                message=f"created on {host.name} with {', '.join(r.model.name for r in resolved)} "
                f"(ports {http_port}/{grpc_port}/{metrics_port})",
            )
    except IntegrityError as exc:
        # Another request took the name or the ports between our check and insert.
        raise ValidationFailed({"name": f"{name!r} or its ports were taken concurrently; try again"}) from exc
    return deployment


def _write_placements(deployment: Deployment, resolved: list[Resolved]) -> None:
    deployment.placements.all().delete()
    for item in resolved:
        spec, model = item.spec, item.model
        engine = model.kind == ModelKind.LLM
        DeploymentModel.objects.create(
            deployment=deployment,
            triton_name=spec.triton_name or model.name,
            registered_model=model,
            engine_build=item.build,
            backend=Backend.LLM_API if spec.llm_api else SERVABLE_KINDS[model.kind],
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


def _resolved_from_snapshot(item: dict[str, Any]) -> Resolved:
    """A placement as a revision recorded it (validated when it was made)."""
    fields = {k: v for k, v in item.items() if k != "kv_cache_tokens"}
    spec = PlacementSpec(
        **{**fields, "preferred_batch_sizes": tuple(item["preferred_batch_sizes"]), "gpu_ids": tuple(item["gpu_ids"])}
    )
    build = EngineBuild.objects.filter(pk=spec.engine_build).first() if spec.engine_build else None
    return Resolved(
        spec=spec,
        model=RegisteredModel.objects.get(name=spec.model),
        build=build,
        gpus=spec.gpu_ids if (build or spec.llm_api) else (),
        kv_cache_tokens=item.get("kv_cache_tokens"),
    )


def deployment_change(*, deployment_id: int, placements: list[PlacementSpec], user: Any = None) -> Deployment:
    """Give a deployment new placements as a new generation.

    A ready deployment applies it in place (its host reloads only the models
    that changed, and rolls back if the new generation fails to load); one at
    rest takes it at its next start. Refused while it is starting or stopping.
    """
    require_operator(user)
    with transaction.atomic():
        deployment = Deployment.objects.select_related("host").select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        running = deployment.status == DeploymentStatus.READY
        if not running and deployment.status not in states.AT_REST:
            raise InvalidTransition(f"{deployment.name} is {deployment.status}; change it when it is ready or stopped")
        resolved = _validate_placements(deployment.host, placements, runtime=deployment.runtime, image=deployment.image)
        before = placements_snapshot(deployment)
        _write_placements(deployment, resolved)
        after = placements_snapshot(deployment)
        if after == before:
            raise ValidationFailed({"models": "this is what the deployment already holds: nothing to change"})
        generation = deployment.generation + 1
        Deployment.objects.filter(pk=deployment.pk).update(generation=generation)
        deployment.revisions.filter(status=RevisionStatus.CURRENT).update(status=RevisionStatus.SUPERSEDED)
        DeploymentRevision.objects.create(
            deployment=deployment,
            generation=generation,
            spec=after,
            created_by=events.signed_in(user),
        )
        events.record(
            kind="deployment.changed",
            source=events.source_of(user),
            actor=user,
            deployment=deployment,
            message=f"generation {generation}: {', '.join(p['triton_name'] for p in after)}",
            data={"before": before, "after": after},
        )
        if running:
            deployment = deployment_transition(
                deployment_id=deployment.pk,
                to=DeploymentStatus.UPDATING,
                source=events.source_of(user),
                actor=user,
                only_from=frozenset({DeploymentStatus.READY}),
                message=f"applying generation {generation}",
            )
            _enqueue("workers.tasks.apply_generation", deployment, generation)
    return Deployment.objects.select_related("host").get(pk=deployment_id)


def deployment_rollback(*, deployment_id: int, failed_generation: int, reason: str, source: str) -> Deployment:
    """Put back the placements of the generation before ``failed_generation`` (its host
    then reloads them); the failed revision keeps its reason."""
    with transaction.atomic():
        deployment = Deployment.objects.select_related("host").select_for_update().get(pk=deployment_id)
        if deployment.generation != failed_generation:
            raise InvalidTransition(
                f"{deployment.name} is at generation {deployment.generation}, not {failed_generation}"
            )
        previous = deployment.revisions.filter(status=RevisionStatus.SUPERSEDED).order_by("-generation").first()
        if previous is None:
            raise InvalidTransition(f"{deployment.name} has no earlier generation to roll back to")
        _write_placements(deployment, [_resolved_from_snapshot(item) for item in previous.spec])
        Deployment.objects.filter(pk=deployment.pk).update(generation=previous.generation)
        deployment.revisions.filter(generation=failed_generation).update(status=RevisionStatus.FAILED, message=reason)
        DeploymentRevision.objects.filter(pk=previous.pk).update(status=RevisionStatus.CURRENT)
        events.record(
            kind="deployment.rollback",
            source=source,
            deployment=deployment,
            message=f"generation {failed_generation} failed ({reason}); back to generation {previous.generation}",
        )
    return Deployment.objects.select_related("host").get(pk=deployment_id)


def deployment_transition(
    *,
    deployment_id: int,
    to: str,
    source: str,
    message: str = "",
    actor: Any = None,
    only_from: frozenset[str] | None = None,
    runtime_handle: str | None = None,
    desired_state: str | None = None,
    data: dict[str, Any] | None = None,
) -> Deployment:
    """Move a deployment to ``to`` if the table allows it from its current status.

    ``only_from`` narrows the allowed sources further (a worker that finished
    loading only moves ``loading`` to ``ready``). A compare-and-swap update
    makes concurrent callers safe: if the row changed under us, nothing is
    written and InvalidTransition is raised.
    """
    allowed_from = states.sources_of(to)
    if only_from is not None:
        allowed_from = allowed_from & only_from
    with transaction.atomic():
        current = Deployment.objects.filter(pk=deployment_id).values_list("status", flat=True).first()
        if current is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        fields: dict[str, Any] = {"status": to, "status_message": message, "status_changed_at": timezone.now()}
        if runtime_handle is not None:
            fields["runtime_handle"] = runtime_handle
        if desired_state is not None:
            fields["desired_state"] = desired_state
        changed = Deployment.objects.filter(pk=deployment_id, status=current, status__in=allowed_from).update(**fields)
        if not changed:
            raise InvalidTransition(f"cannot go from {current} to {to}")
        deployment = Deployment.objects.select_related("host").get(pk=deployment_id)
        events.record(
            kind="deployment.status",
            source=source,
            actor=actor,
            deployment=deployment,
            from_status=current,
            to_status=to,
            message=message,
            data=data,
        )
    return deployment


def _enqueue(task_name: str, deployment: Deployment, *more_args: Any) -> None:
    queue = deployment.host.queue
    args = [deployment.pk, *more_args]
    transaction.on_commit(lambda: celery_app.send_task(task_name, args=args, queue=queue))


def deployment_start(*, deployment_id: int, user: Any = None) -> Deployment:
    """Ask the deployment's host to launch it; refused unless it is at rest."""
    require_operator(user)
    deployment = _get_deployment(deployment_id)
    if deployment.status not in states.sources_of(DeploymentStatus.LAUNCHING):
        raise InvalidTransition(
            f"{deployment.name} is {deployment.status}; only a stopped, failed or new deployment can start"
        )
    with transaction.atomic():
        deployment = deployment_transition(
            deployment_id=deployment_id,
            to=DeploymentStatus.LAUNCHING,
            source=events.source_of(user),
            actor=user,
            message=f"start requested; waiting for {deployment.host.name}",
            desired_state=DesiredState.RUNNING,
        )
        _enqueue("workers.tasks.launch_deployment", deployment)
    return deployment


def deployment_stop(*, deployment_id: int, user: Any = None) -> Deployment:
    """Ask the deployment's host to stop its server; refused when nothing runs."""
    require_operator(user)
    deployment = _get_deployment(deployment_id)
    if deployment.status not in states.sources_of(DeploymentStatus.STOPPING):
        raise InvalidTransition(f"{deployment.name} is {deployment.status}; there is nothing to stop")
    with transaction.atomic():
        deployment = deployment_transition(
            deployment_id=deployment_id,
            to=DeploymentStatus.STOPPING,
            source=events.source_of(user),
            actor=user,
            message="stop requested",
            desired_state=DesiredState.STOPPED,
        )
        _enqueue("workers.tasks.stop_deployment", deployment)
    return deployment


def _get_deployment(deployment_id: int) -> Deployment:
    deployment = Deployment.objects.select_related("host").filter(pk=deployment_id).first()
    if deployment is None:
        raise NotFound(f"deployment {deployment_id} does not exist")
    return deployment


def deployment_relaunch(*, deployment_id: int, source: str, attempt: int) -> Deployment:
    """Restart a failed deployment that should be running (a crashed server)."""
    with transaction.atomic():
        deployment = deployment_transition(
            deployment_id=deployment_id,
            to=DeploymentStatus.LAUNCHING,
            source=source,
            only_from=frozenset({DeploymentStatus.FAILED}),
            message=f"restarting after a crash (attempt {attempt})",
        )
        events.record(
            kind="deployment.crash_restart",
            source=source,
            deployment=deployment,
            message=f"automatic restart {attempt} of {settings.GANTRY_CRASH_RESTART_LIMIT}",
        )
        _enqueue("workers.tasks.launch_deployment", deployment)
    return deployment


def deployment_redrive(*, deployment_id: int, source: str, message: str) -> None:
    """Send a launching deployment's launch task again (the first was lost with its worker).

    A duplicate is harmless: a launch task acts only on a launching row, and
    only one of two racing launches can move it on.
    """
    with transaction.atomic():
        deployment = Deployment.objects.select_related("host").select_for_update().get(pk=deployment_id)
        if deployment.status != DeploymentStatus.LAUNCHING:
            raise InvalidTransition(f"{deployment.name} is {deployment.status}, not launching")
        events.record(kind="deployment.redrive", source=source, deployment=deployment, message=message)
        _enqueue("workers.tasks.launch_deployment", deployment)


def record_deployment_event(*, deployment_id: int, kind: str, source: str, message: str) -> None:
    """Note something about a deployment on its timeline without changing its status."""
    with transaction.atomic():
        deployment = _get_deployment(deployment_id)
        events.record(kind=kind, source=source, deployment=deployment, message=message)


def metrics_record(
    *,
    deployment_id: int,
    models: dict[str, dict[str, float]],
    gpus: dict[str, dict[str, float]],
) -> None:
    """Store one scrape's figures, prune samples past the retention window, and
    push the figures to the deployment's page."""
    now = timezone.now()
    MetricSample.objects.bulk_create(
        [
            *(
                MetricSample(deployment_id=deployment_id, at=now, kind="model", subject=k, values=v)
                for k, v in models.items()
            ),
            *(
                MetricSample(deployment_id=deployment_id, at=now, kind="gpu", subject=k, values=v)
                for k, v in gpus.items()
            ),
        ]
    )
    cutoff = now - timedelta(hours=settings.GANTRY_METRICS_RETENTION_HOURS)
    MetricSample.objects.filter(deployment_id=deployment_id, at__lt=cutoff).delete()
    events.publish(
        events.deployment_group(deployment_id),
        {"type": "metrics", "deployment": deployment_id, "at": now.isoformat(), "models": models, "gpus": gpus},
    )


def record_host_event(*, host_name: str, kind: str, source: str, message: str) -> None:
    """Note something about a host on its timeline."""
    with transaction.atomic():
        host = GpuHost.objects.get(name=host_name)
        events.record(kind=kind, source=source, host=host, message=message)


# How many log lines a deployment keeps; older ones are deleted as new ones arrive.
LOG_LINES_KEPT = 1000


def log_lines_append(*, deployment_id: int, lines: list[str]) -> None:
    """Store a batch of server log lines (one insert), trim to the newest LOG_LINES_KEPT, and push them."""
    if not lines:
        return
    append_newest_lines(LogLine, keep=LOG_LINES_KEPT, lines=lines, deployment_id=deployment_id)
    events.publish(events.deployment_group(deployment_id), {"type": "log", "deployment": deployment_id, "lines": lines})


def append_newest_lines(
    model: type[LogLine] | type[BuildLogLine], *, keep: int, lines: list[str], **owner: int
) -> None:
    """Insert ``lines`` for ``owner`` in one statement and delete all but its newest ``keep``."""
    model.objects.bulk_create(model(**owner, line=line[:4000]) for line in lines)
    oldest_kept = model.objects.filter(**owner).order_by("-id").values_list("id", flat=True)[keep:].first()
    if oldest_kept is not None:
        model.objects.filter(**owner, id__lte=oldest_kept).delete()
