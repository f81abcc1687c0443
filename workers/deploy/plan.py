"""Turning a replica's rows into what its host runs: the Triton model specs of
its deployment's placements (each from its backend, by the replica's plan), the
LaunchSpec of its server (ports, image, GPUs, mounts, MPI ranks), where its
files live, and which runtime runs it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from deployments import backends
from deployments.backends.base import Placed
from deployments.models import DeploymentStatus, DesiredState, InstanceKind, Replica
from deployments.models import Runtime as DeploymentRuntime
from deployments.services import replicas
from triton_server.client import TritonClient
from triton_server.repository import ModelSpec
from triton_server.server import LOCAL, LaunchSpec
from workers.engines.verify import engine_files_problem
from workers.jobs import source
from workers.runtimes.base import Runtime
from workers.runtimes.docker import DockerRuntime, PullProgress
from workers.runtimes.process import ProcessRuntime


@dataclass(frozen=True)
class Paths:
    root: Path

    @property
    def repository(self) -> Path:
        return self.root / "repository"

    @property
    def log(self) -> Path:
        return self.root / "tritonserver.log"


def deployment_root(deployment_id: int, name: str) -> Path:
    """The folder of everything a deployment's replicas keep on this host."""
    return settings.GANTRY_DATA_DIR / "deployments" / f"{deployment_id}-{name}"


def paths_for(replica: Replica) -> Paths:
    return Paths(deployment_root(replica.deployment_id, replica.deployment.name) / replica.label)


def load(replica_id: int) -> Replica | None:
    """The replica with everything planning reads (its deployment's placements,
    builds, the host's GPUs), or None."""
    return (
        Replica.objects.select_related("deployment", "host")
        .prefetch_related(
            "deployment__placements__registered_model__host", "deployment__placements__engine_build", "host__gpus"
        )
        .filter(pk=replica_id)
        .first()
    )


@dataclass(frozen=True)
class MissingInput:
    placement: str
    problem: str
    build_id: int | None = None  # an engine build whose folder is gone or changed

    def describe(self) -> str:
        return f"{self.placement}: {self.problem}"


def missing_inputs(replica: Replica) -> list[MissingInput]:
    """What the deployment's placements read that is not on this host: a
    checkpoint (registered on another host, or removed since), or an engine
    build's folder that is gone or changed."""
    found: list[MissingInput] = []
    for placement in replica.deployment.placements.all():
        model = placement.registered_model
        if not model.folder.exists():
            where = f"{model.hub_id} (not downloaded here)" if model.downloaded else model.path
            found.append(
                MissingInput(
                    placement.triton_name,
                    f"checkpoint {where} (registered on {model.host.name}) is not on {settings.GANTRY_HOST_NAME}",
                )
            )
        build = placement.engine_build
        if build is not None and (problem := engine_files_problem(build)):
            found.append(MissingInput(placement.triton_name, problem, build.pk))
    return found


def replica_plan(replica: Replica) -> dict[str, Any]:
    """What the replica runs, as the control plane resolved it when it sent the
    launch or the generation (Replica.plan). A replica placed before plans were
    stored has none for its deployment's generation: it is resolved here once,
    by the same code."""
    stored = replica.plan or {}
    if stored.get("generation") == replica.deployment.generation:
        return stored
    return backends.replica_plan(
        replica.deployment.placements.all(), replica.gpus, len(replica.host.gpus.all()), replica.deployment.generation
    )


def server_gpus(replica: Replica) -> tuple[int, ...]:
    """Every host GPU the replica's server uses, in order."""
    return tuple(replica_plan(replica)["gpus"])


def model_specs(replica: Replica) -> list[ModelSpec]:
    """Triton model specs for the deployment's placements, each built by its
    backend from the replica's plan, with GPUs numbered as the replica's server
    sees them: the host's indexes for a process, and for a container the
    positions among the GPUs Docker hands it (it renumbers them from 0)."""
    deployment = replica.deployment
    plan = replica_plan(replica)
    placed = {item["triton_name"]: Placed.from_json(item) for item in plan["models"]}
    if deployment.runtime == DeploymentRuntime.DOCKER:
        seen = {host_index: i for i, host_index in enumerate(plan["gpus"])}
    else:
        seen = {}
    specs: list[ModelSpec] = []
    for placement in deployment.placements.all():
        item = placed[placement.triton_name]
        devices = tuple(seen.get(g, g) for g in item.gpus)
        specs.append(backends.backend_of(placement).model_spec(placement, item, devices, deployment.image))
    return specs


def triton_client(replica: Replica) -> TritonClient:
    """A client of the replica's server on this host, allowed its admin APIs."""
    return TritonClient(
        f"{LOCAL}:{replica.http_port}",
        replica.deployment.admin_secret,
        load_timeout_s=settings.GANTRY_TRITON_READY_TIMEOUT,
        network_timeout_s=settings.GANTRY_TRITON_REQUEST_TIMEOUT,
    )


def current_status(replica_id: int) -> str | None:
    return Replica.objects.filter(pk=replica_id).values_list("status", flat=True).first()


def runtime_for(replica: Replica) -> Runtime:
    if replica.deployment.runtime == DeploymentRuntime.DOCKER:
        return DockerRuntime(settings.GANTRY_HOST_NAME, settings.GANTRY_DATA_DIR, PullNotes(replica.pk))
    return ProcessRuntime(settings.GANTRY_DATA_DIR)


class PullNotes:
    """A replica's image pull on its timeline: when it starts, every NOTE_EVERY_S, and when done."""

    NOTE_EVERY_S = 5.0

    def __init__(self, replica_id: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.replica_id = replica_id
        self.clock = clock
        self.noted_at: float | None = None

    def __call__(self, progress: PullProgress) -> None:
        now = self.clock()
        finished = progress.layers and progress.layers_done == progress.layers
        if self.noted_at is not None and now - self.noted_at < self.NOTE_EVERY_S and not finished:
            return
        self.noted_at = now
        replicas.record_replica_event(
            replica_id=self.replica_id, kind="replica.image_pull", source=source(), message=progress.words()
        )


# Beside a GPU a model process needs few CPU threads: tokenizing, the batch's bookkeeping.
GPU_SIDE_THREADS = 4
# What sizes the thread pools of torch (intra-op), BLAS and the tokenizers in a model process.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")


def replica_threads(replica: Replica) -> int:
    """The threads each model process of the replica may use, set as it starts:
    its share of the cores this worker may run on, split between the replicas
    on this host that run or should, and between its own CPU instances; beside
    a GPU, at most GPU_SIDE_THREADS. Left to themselves, every python-backend
    process sizes its pools for the whole machine, and replicas on one host
    fight over its cores (three MiniLM replicas on two cores served 15 req/s
    against ~100 for one). OMP_NUM_THREADS in the worker's own environment
    overrides it, as the host's operator's choice."""
    if (fixed := os.environ.get(THREAD_VARIABLES[0], "")).isdigit() and int(fixed) > 0:
        return int(fixed)
    cores = len(os.sched_getaffinity(0))
    sharing = (
        Replica.objects.filter(host_id=replica.host_id, desired_state=DesiredState.RUNNING)
        .exclude(status__in=(DeploymentStatus.STOPPED, DeploymentStatus.FAILED, DeploymentStatus.LOST))
        .count()
    )
    share = max(1, cores // max(1, sharing))
    cpu_instances = sum(
        item["instance_count"] for item in replica_plan(replica)["models"] if item["instance_kind"] == InstanceKind.CPU
    )
    if cpu_instances:
        return max(1, share // cpu_instances)
    return min(GPU_SIDE_THREADS, share)


def launch_spec(replica: Replica) -> LaunchSpec:
    """How to run the replica's server: its repository, ports, image, GPUs,
    checkpoint and engine mounts, and one MPI rank per GPU of a multi-GPU engine."""
    deployment = replica.deployment
    paths = paths_for(replica)
    placements = list(deployment.placements.all())
    served = [(p, backends.backend_of(p)) for p in placements]
    return LaunchSpec(
        deployment_id=deployment.pk,
        replica_id=replica.pk,
        generation=deployment.generation,
        repository=paths.repository,
        models=[name for p, backend in served for name in backend.triton_models(p.triton_name)],
        world_size=max((backend.world_size(p) for p, backend in served), default=1),
        engine_models=[name for p, backend in served for name in backend.rank_models(p)],
        http_port=replica.http_port,
        grpc_port=replica.grpc_port,
        metrics_port=replica.metrics_port,
        log_path=paths.log,
        image=deployment.image,
        gpu_ids=server_gpus(replica),
        ulimits=tuple(settings.GANTRY_DOCKER_ULIMITS),
        admin_secret=deployment.admin_secret,
        shm_size_mib=deployment.shm_size_mib,
        log_verbose=deployment.log_verbose,
        extra_env={
            **dict.fromkeys(THREAD_VARIABLES, str(replica_threads(replica))),
            **{k: v for p, backend in served for k, v in backend.server_env(p, paths.repository).items()},
        },
        read_only_mounts=tuple(sorted({path for p, backend in served for path in backend.mounts(p)})),
    )
