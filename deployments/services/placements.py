"""Model placements: what one model of a deployment asks of its host (batching,
instances, GPUs and memory, and for an llm the engine or LLM-API path), the
rules a set of placements must pass before anything is written, and their
snapshots in revisions.

A placement's fields, defaults and bounds are defined once, on
``DeploymentModel``; ``PlacementSpec`` (deployments.backends.base) takes its
defaults from there and the API serializer and the browser form derive their
fields from it. The rules of each serving backend live in its module
(deployments.backends); here are those every placement passes and those of
the deployment as a whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from django.core.validators import MaxValueValidator

from common.errors import ValidationFailed
from common.words import a
from deployments.backends import BACKENDS, SERVABLE_KINDS, backend_for, backend_of
from deployments.backends.base import PlacementSpec, Resolved, Target, queue_delay_us
from deployments.gpu_plan import Holder, host_plan, plan_problems
from deployments.models import (
    Backend,
    Deployment,
    DeploymentModel,
    EngineBuild,
    Inspection,
    InstanceKind,
    RegisteredModel,
    TimeoutAction,
)
from hosts.models import GpuHost

__all__ = ["PlacementSpec", "Resolved"]  # defined with the backends, used through here by the doors and tests

# Every field a placement request may carry, in PlacementSpec's order.
PLACEMENT_FIELDS = tuple(f.name for f in fields(PlacementSpec))
MAX_BATCH_SIZE = min(
    v.limit_value
    for v in DeploymentModel._meta.get_field("max_batch_size").validators
    if isinstance(v, MaxValueValidator)
)

Fail = Callable[[str, str], None]


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
    target = Target(host=host, runtime=runtime, image=image)
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
        backend = backend_for(spec, model)
        if backend is not None and (item := backend.check(spec, model, target, fail)) is not None:
            resolved.append(item)
    rows = placement_rows(resolved)
    for backend in BACKENDS:
        for field, problems in backend.check_deployment(specs, resolved, rows, sorted(gpu_indexes)).items():
            errors.setdefault(field, []).extend(problems)
    if not gpu_indexes:
        _check_auto_on_no_gpus(host, rows, errors)
    own = host_plan(host, [Holder(key=None, name="this deployment", placements=rows)])
    errors.setdefault("models", []).extend(plan_problems(own, own=None))
    if not errors["models"]:
        del errors["models"]
    return resolved, errors


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
        own_gpus = backend_of(item.backend).places_own_gpus
        values = {name: getattr(spec, name) for name in _STORED}
        values["preferred_batch_sizes"] = list(spec.preferred_batch_sizes)
        values["max_queue_delay_us"] = queue_delay_us(spec, model)
        rows.append(
            DeploymentModel(
                **({"deployment": deployment} if deployment is not None else {}),
                **values,
                triton_name=spec.triton_name or model.name,
                registered_model=model,
                engine_build=item.build,
                backend=item.backend,
                # An engine's GPUs are its own (gpu_device_ids); for the plan they count as a GPU placement.
                instance_kind=InstanceKind.GPU if own_gpus else spec.instance_kind,
                gpu_ids=list(item.gpus) if own_gpus else list(spec.gpu_ids),
                kv_cache_tokens=item.kv_cache_tokens,
            )
        )
    return rows


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
    model = RegisteredModel.objects.get(name=spec.model)
    return Resolved(
        spec=spec,
        model=model,
        backend=backend_for(spec, model).key,
        build=build,
        gpus=spec.gpu_ids if (build or spec.llm_api) else (),
        kv_cache_tokens=item.get("kv_cache_tokens"),
    )


def spec_from_snapshot(item: dict[str, Any]) -> PlacementSpec:
    """The spec a revision recorded; fields it predates take their defaults."""
    return PlacementSpec.from_fields({k: v for k, v in item.items() if k in PLACEMENT_FIELDS})
