"""Where a placement's model instances run, decided once for validation,
planning and the host that writes the Triton config."""

from __future__ import annotations

from collections.abc import Iterable

from deployments.models import InstanceKind


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
