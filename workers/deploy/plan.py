"""Turning a replica's rows into what its host runs: the Triton model specs of
its deployment's placements (their GPUs mapped onto the host's), the
LaunchSpec of its server (ports, image, GPUs, mounts, MPI ranks), where its
files live, and which runtime runs it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from common.errors import PermanentError
from deployments import trtllm
from deployments.gpu_plan import DEFAULT_KV_CACHE_SHARE, replica_gpus, resolve_instances, transformers_max_seq_len
from deployments.models import Backend, DeploymentModel, ModelKind, Replica
from deployments.models import Runtime as DeploymentRuntime
from triton_server.client import TritonClient
from triton_server.config import (
    EMBED,
    LLMAPI_CONFIG_FILE,
    RERANK,
    Batching,
    CausalLmSpec,
    Instances,
    LlmApiSpec,
    PythonModelSpec,
    TrtllmSpec,
)
from triton_server.names import engine_model
from triton_server.repository import ModelSpec
from triton_server.server import LOCAL, LaunchSpec
from workers.engines.verify import engine_files_problem
from workers.runtimes.base import Runtime
from workers.runtimes.docker import DockerRuntime
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


def _batching(placement: DeploymentModel) -> Batching:
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
        if not Path(model.path).exists():
            found.append(
                MissingInput(
                    placement.triton_name,
                    f"checkpoint {model.path} (registered on {model.host.name}) is not on {settings.GANTRY_HOST_NAME}",
                )
            )
        build = placement.engine_build
        if build is not None and (problem := engine_files_problem(build)):
            found.append(MissingInput(placement.triton_name, problem, build.pk))
    return found


def server_gpus(replica: Replica) -> tuple[int, ...]:
    """Every host GPU the replica's server uses, in order."""
    count = len(replica.host.gpus.all())
    return tuple(sorted({g for p in replica.deployment.placements.all() for g in replica_gpus(p, replica.gpus, count)}))


def model_specs(replica: Replica) -> list[ModelSpec]:
    """Triton model specs for the deployment's placements, with GPUs numbered as
    the replica's server sees them: its host indexes (through the replica's GPU
    map) for a process, and for a container the positions among the GPUs Docker
    hands it (it renumbers them from 0)."""
    deployment = replica.deployment
    host_gpus = sorted(gpu.index for gpu in replica.host.gpus.all())
    logical = range(len(host_gpus))
    if deployment.runtime == DeploymentRuntime.DOCKER:
        seen = {host_index: i for i, host_index in enumerate(server_gpus(replica))}
    else:
        seen = {index: index for index in host_gpus}

    def visible(gpus: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        return tuple(seen.get(h, h) for h in (replica.gpus.get(g, g) for g in gpus))

    specs: list[ModelSpec] = []
    for placement in deployment.placements.all():
        model = placement.registered_model
        if placement.backend == Backend.LLM_API:
            release = trtllm.release_for(settings.GANTRY_BUILDER_IMAGES.get(deployment.image, ""))
            if release is None or not release.llmapi_model_dir:
                raise PermanentError(f"{deployment.image} has no LLM-API backend in Gantry's version table")
            devices = visible(placement.gpu_ids)
            if devices != tuple(range(len(devices))):
                # LLM() takes no device ids: its ranks take the container's first GPUs (placements_check).
                raise PermanentError(
                    f"{placement.triton_name} would run on the container's first {len(devices)} GPU(s), not on its "
                    f"own GPUs {list(placement.gpu_ids)}: place the LLM-API model on the deployment's lowest GPUs"
                )
            specs.append(
                LlmApiSpec(
                    name=placement.triton_name,
                    checkpoint_path=model.path,
                    image_model_dir=release.llmapi_model_dir,
                    gpu_device_ids=devices,
                    max_batch_size=placement.max_num_sequences or placement.max_batch_size,
                    max_tokens_in_kv_cache=placement.kv_cache_tokens,
                    kv_cache_free_gpu_mem_fraction=_kv_share(placement),
                    enable_block_reuse=placement.enable_kv_cache_reuse,
                    max_seq_len=placement.max_seq_len,
                    trust_remote_code=model.trust_remote_code,
                    decoupled=placement.decoupled,
                )
            )
            continue
        if placement.backend == Backend.TENSORRTLLM:
            build = placement.engine_build
            specs.append(
                TrtllmSpec(
                    name=placement.triton_name,
                    engine_dir=build.output_dir,
                    tokenizer_dir=model.path,
                    batching=_batching(placement),
                    gpu_device_ids=visible(placement.gpu_ids),
                    max_beam_width=int(build.spec.get("max_beam_width", 1)),
                    batch_scheduler_policy=placement.batch_scheduler_policy,
                    kv_cache_free_gpu_mem_fraction=_kv_share(placement),
                    max_tokens_in_paged_kv_cache=placement.kv_cache_tokens,
                    decoupled=placement.decoupled,
                    enable_kv_cache_reuse=placement.enable_kv_cache_reuse,
                    decoding_mode=placement.decoding_mode,
                    trust_remote_code=model.trust_remote_code,
                )
            )
            continue
        kind, gpus = resolve_instances(placement.instance_kind, placement.gpu_ids, logical)
        instances = Instances(count=placement.instance_count, kind=kind, gpus=visible(gpus))
        if placement.backend == Backend.TRANSFORMERS:
            specs.append(
                CausalLmSpec(
                    name=placement.triton_name,
                    checkpoint_path=model.path,
                    batching=_batching(placement),
                    instances=instances,
                    gpu_memory_fraction=placement.gpu_memory_fraction,
                    trust_remote_code=model.trust_remote_code,
                    dtype=placement.dtype,
                    max_num_sequences=placement.max_num_sequences or placement.max_batch_size,
                    max_seq_len=transformers_max_seq_len(model, placement.max_seq_len),
                )
            )
            continue
        specs.append(
            PythonModelSpec(
                name=placement.triton_name,
                task=RERANK if model.kind == ModelKind.RERANKER else EMBED,
                checkpoint_path=model.path,
                batching=_batching(placement),
                instances=instances,
                gpu_memory_fraction=placement.gpu_memory_fraction,
                max_seq_len=placement.max_seq_len,
                dtype=placement.dtype,
                trust_remote_code=model.trust_remote_code,
            )
        )
    return specs


def _kv_share(placement: DeploymentModel) -> float:
    if placement.kv_cache_free_gpu_mem_fraction is None:
        return DEFAULT_KV_CACHE_SHARE
    return placement.kv_cache_free_gpu_mem_fraction


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
        return DockerRuntime(settings.GANTRY_HOST_NAME, settings.GANTRY_DATA_DIR)
    return ProcessRuntime(settings.GANTRY_DATA_DIR)


def _server_env(paths: Paths, placements: list[DeploymentModel]) -> dict[str, str]:
    """The LLM-API model finds its model.yaml through LLM_CONFIG_PATH (so a server holds at most one)."""
    for placement in placements:
        if placement.backend == Backend.LLM_API:
            return {"LLM_CONFIG_PATH": str(paths.repository / placement.triton_name / LLMAPI_CONFIG_FILE)}
    return {}


def launch_spec(replica: Replica) -> LaunchSpec:
    """How to run the replica's server: its repository, ports, image, GPUs,
    checkpoint and engine mounts, and one MPI rank per GPU of a multi-GPU engine."""
    deployment = replica.deployment
    paths = paths_for(replica)
    placements = list(deployment.placements.all())
    engines = [p for p in placements if p.engine_build_id]
    return LaunchSpec(
        deployment_id=deployment.pk,
        replica_id=replica.pk,
        generation=deployment.generation,
        repository=paths.repository,
        models=[name for p in placements for name in p.triton_models],
        world_size=max((p.engine_build.world_size for p in engines), default=1),
        engine_models=[engine_model(p.triton_name) for p in engines],
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
        extra_env=_server_env(paths, placements),
        read_only_mounts=tuple(
            sorted(
                {Path(p.registered_model.path) for p in placements} | {Path(p.engine_build.output_dir) for p in engines}
            )
        ),
    )
