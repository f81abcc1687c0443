"""What a GPU host does for a deployment: write its model repository, start
and stop its Triton server, and keep its status true to what runs.

Every status change goes through deployments.services.deployment_transition;
every step re-reads the row, so a task delivered twice, or one racing a stop,
ends in the state the database asks for.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from deployments import services, states, trtllm
from deployments.errors import GantryError, InvalidTransition, PermanentError, TransientError
from deployments.models import (
    Backend,
    Deployment,
    DeploymentModel,
    DeploymentStatus,
    DesiredState,
    Event,
    ModelKind,
)
from deployments.models import Runtime as DeploymentRuntime
from deployments.placement import resolve_instances, triton_model_names
from workers import nvml
from workers.runtimes import LaunchSpec, Runtime, busy_ports
from workers.runtimes.docker import DockerRuntime
from workers.runtimes.process import ProcessRuntime
from workers.triton import metrics
from workers.triton.client import Readiness, TritonClient
from workers.triton.config import (
    CONFIG_FILE,
    EMBED,
    LLMAPI_CONFIG_FILE,
    RERANK,
    Batching,
    Instances,
    LlmApiSpec,
    PythonModelSpec,
    TrtllmSpec,
)
from workers.triton.repository import ModelSpec, write_repository

log = logging.getLogger(__name__)
S = DeploymentStatus


def source() -> str:
    return f"worker:{settings.GANTRY_HOST_NAME}"


@dataclass(frozen=True)
class Paths:
    root: Path

    @property
    def repository(self) -> Path:
        return self.root / "repository"

    @property
    def log(self) -> Path:
        return self.root / "tritonserver.log"


def paths_for(deployment: Deployment) -> Paths:
    return Paths(settings.GANTRY_DATA_DIR / "deployments" / f"{deployment.pk}-{deployment.name}")


def _load(deployment_id: int) -> Deployment | None:
    return (
        Deployment.objects.select_related("host")
        .prefetch_related("placements__registered_model", "placements__engine_build", "host__gpus")
        .filter(pk=deployment_id)
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
    )


def model_specs(deployment: Deployment) -> list[ModelSpec]:
    """Triton model specs for the deployment's placements on its host."""
    host_gpus = sorted(gpu.index for gpu in deployment.host.gpus.all())
    specs: list[ModelSpec] = []
    for placement in deployment.placements.all():
        model = placement.registered_model
        if placement.backend == Backend.LLM_API:
            release = trtllm.release_for(settings.GANTRY_BUILDER_IMAGES.get(deployment.image, ""))
            if release is None or not release.llmapi_model_dir:
                raise PermanentError(f"{deployment.image} has no LLM-API backend in Gantry's version table")
            specs.append(
                LlmApiSpec(
                    name=placement.triton_name,
                    checkpoint_path=model.path,
                    image_model_dir=release.llmapi_model_dir,
                    gpu_device_ids=tuple(placement.gpu_ids),
                    max_batch_size=placement.max_batch_size,
                    max_tokens_in_kv_cache=placement.kv_cache_tokens,
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
                    gpu_device_ids=tuple(placement.gpu_ids),
                    max_beam_width=int(build.spec.get("max_beam_width", 1)),
                    batch_scheduler_policy=placement.batch_scheduler_policy,
                    max_tokens_in_paged_kv_cache=placement.kv_cache_tokens,
                    decoupled=placement.decoupled,
                )
            )
            continue
        kind, gpus = resolve_instances(placement.instance_kind, placement.gpu_ids, host_gpus)
        if not model.hidden_size:
            raise PermanentError(f"{model.name}: its config.json gives no hidden_size")
        specs.append(
            PythonModelSpec(
                name=placement.triton_name,
                task=RERANK if model.kind == ModelKind.RERANKER else EMBED,
                checkpoint_path=model.path,
                embedding_dim=model.hidden_size,
                batching=_batching(placement),
                instances=Instances(count=placement.instance_count, kind=kind, gpus=gpus),
                gpu_memory_fraction=placement.gpu_memory_fraction,
            )
        )
    return specs


def _spec_gpus(spec: ModelSpec) -> tuple[int, ...]:
    return spec.instances.gpus if isinstance(spec, PythonModelSpec) else spec.gpu_device_ids


def _client(deployment: Deployment) -> TritonClient:
    return TritonClient(f"{settings.GANTRY_HOST_ADDRESS}:{deployment.http_port}", deployment.admin_secret)


def _status(deployment_id: int) -> str | None:
    return Deployment.objects.filter(pk=deployment_id).values_list("status", flat=True).first()


def runtime_for(deployment: Deployment) -> Runtime:
    if deployment.runtime == DeploymentRuntime.DOCKER:
        return DockerRuntime(settings.GANTRY_HOST_NAME)
    return ProcessRuntime(settings.GANTRY_DATA_DIR)


def _server_env(paths: Paths, placements: list[DeploymentModel]) -> dict[str, str]:
    """The LLM-API model finds its model.yaml through LLM_CONFIG_PATH (so a server holds at most one)."""
    for placement in placements:
        if placement.backend == Backend.LLM_API:
            return {"LLM_CONFIG_PATH": str(paths.repository / placement.triton_name / LLMAPI_CONFIG_FILE)}
    return {}


def launch_spec(deployment: Deployment, specs: list[ModelSpec] | None = None) -> LaunchSpec:
    """How to run the deployment's server: its repository, ports, image, GPUs,
    checkpoint and engine mounts, and one MPI rank per GPU of a multi-GPU engine."""
    paths = paths_for(deployment)
    placements = list(deployment.placements.all())
    engines = [p for p in placements if p.engine_build_id]
    return LaunchSpec(
        deployment_id=deployment.pk,
        generation=deployment.generation,
        repository=paths.repository,
        models=triton_model_names(placements),
        world_size=max((p.engine_build.world_size for p in engines), default=1),
        engine_models=[f"{p.triton_name}-engine" for p in engines],
        http_port=deployment.http_port,
        grpc_port=deployment.grpc_port,
        metrics_port=deployment.metrics_port,
        log_path=paths.log,
        bind_address=settings.GANTRY_HOST_ADDRESS,
        image=deployment.image,
        gpu_ids=tuple(sorted({gpu for spec in specs or [] for gpu in _spec_gpus(spec)})),
        ulimits=tuple(settings.GANTRY_DOCKER_ULIMITS),
        admin_secret=deployment.admin_secret,
        extra_env=_server_env(paths, placements),
        read_only_mounts=tuple(
            sorted(
                {Path(p.registered_model.path) for p in placements} | {Path(p.engine_build.output_dir) for p in engines}
            )
        ),
    )


def _fail(deployment: Deployment, reason: str, *, tail: str = "", only_from: frozenset[str]) -> None:
    try:
        services.deployment_transition(
            deployment_id=deployment.pk,
            to=S.FAILED,
            source=source(),
            only_from=only_from,
            runtime_handle="",
            message=reason,
            data={"log_tail": tail} if tail else None,
        )
    except InvalidTransition:
        log.info("deployment %s moved on before it could be marked failed", deployment.pk)


def launch(deployment_id: int) -> None:
    """Start the deployment's Triton server and wait until every model is ready."""
    deployment = _load(deployment_id)
    if deployment is None or deployment.status != S.LAUNCHING:
        log.info("launch of %s skipped: status is %s", deployment_id, deployment and deployment.status)
        return
    runtime = runtime_for(deployment)
    try:
        specs = model_specs(deployment)
        spec = launch_spec(deployment, specs)
        if deployment.runtime_handle and runtime.is_running(deployment.runtime_handle, spec):
            # A redelivered task: the server from the first delivery still runs.
            runtime.stop(deployment.runtime_handle, spec)
        busy = busy_ports(spec.bind_address, [spec.http_port, spec.grpc_port, spec.metrics_port])
        if busy:
            raise PermanentError(
                f"port(s) {', '.join(map(str, busy))} on {settings.GANTRY_HOST_NAME} are already in use "
                "by another program; give the deployment other ports"
            )
        write_repository(spec.repository, specs)
        handle = runtime.start(spec)
    except (GantryError, OSError) as exc:
        _fail(deployment, f"launch failed: {exc}", only_from=frozenset({S.LAUNCHING}))
        return
    try:
        services.deployment_transition(
            deployment_id=deployment_id,
            to=S.LOADING,
            source=source(),
            only_from=frozenset({S.LAUNCHING}),
            runtime_handle=handle,
            message=f"tritonserver ({deployment.runtime} {handle[:12]}) loading {', '.join(spec.models)}",
        )
    except InvalidTransition:
        # Stopped while we were starting: undo our own start.
        runtime.stop(handle, spec)
        return
    _await_ready(deployment, runtime, handle, spec)


def _await_ready(deployment: Deployment, runtime: Runtime, handle: str, spec: LaunchSpec) -> None:
    def keep_waiting() -> bool:
        return runtime.is_running(handle, spec) and _status(deployment.pk) == S.LOADING

    client = _client(deployment)
    try:
        client.wait_until_ready(spec.models, timeout_s=settings.GANTRY_TRITON_READY_TIMEOUT, keep_waiting=keep_waiting)
    except PermanentError:
        if _status(deployment.pk) != S.LOADING:
            return  # stopped or failed elsewhere; the stop task owns the server now
        tail = runtime.log_tail(handle, spec)
        runtime.stop(handle, spec)
        _fail(deployment, "tritonserver exited while loading", tail=tail, only_from=frozenset({S.LOADING}))
        return
    except TransientError as exc:
        tail = runtime.log_tail(handle, spec)
        runtime.stop(handle, spec)
        _fail(deployment, f"tritonserver {exc}", tail=tail, only_from=frozenset({S.LOADING}))
        return
    finally:
        client.close()
    try:
        _mark_ready(deployment, spec.models)
    except InvalidTransition:
        log.info("deployment %s left loading before it became ready", deployment.pk)


def _configs(repository: Path) -> dict[str, str]:
    if not repository.is_dir():
        return {}
    return {d.name: (d / CONFIG_FILE).read_text() for d in repository.iterdir() if (d / CONFIG_FILE).is_file()}


def _swap_models(deployment: Deployment, spec: LaunchSpec, specs: list[ModelSpec]) -> dict[str, list[str]]:
    """Write ``specs`` as the repository and make the running server match it,
    loading only models whose config changed and unloading the ones gone."""
    before = _configs(spec.repository)
    write_repository(spec.repository, specs)
    after = _configs(spec.repository)
    plan = {
        "unloaded": sorted(set(before) - set(after)),
        "loaded": sorted(name for name in after if before.get(name) != after[name]),
        "unchanged": sorted(name for name in after if before.get(name) == after[name]),
    }
    client = _client(deployment)
    try:
        for name in plan["unloaded"]:
            client.unload(name)
        for name in plan["loaded"]:
            client.load(name)
        client.wait_until_ready(sorted(after), timeout_s=settings.GANTRY_TRITON_READY_TIMEOUT, server_ready=False)
    finally:
        client.close()
    return plan


def apply_generation(deployment_id: int, generation: int) -> None:
    """Apply a ready deployment's new generation in place; roll back if it fails."""
    deployment = _load(deployment_id)
    if deployment is None or deployment.status != S.UPDATING or deployment.generation != generation:
        return
    spec = launch_spec(deployment)
    try:
        plan = _swap_models(deployment, spec, model_specs(deployment))
    except GantryError as exc:
        _roll_back(deployment, generation, str(exc))
        return
    services.record_deployment_event(
        deployment_id=deployment.pk,
        kind="deployment.generation_applied",
        source=source(),
        message=f"generation {generation}: loaded {plan['loaded'] or 'none'}, unloaded {plan['unloaded'] or 'none'}, "
        f"left as they were {plan['unchanged'] or 'none'}",
    )
    try:
        _mark_ready(deployment, spec.models, only_from=frozenset({S.UPDATING}))
    except InvalidTransition:
        log.info("deployment %s left updating while its generation %s was applied", deployment.pk, generation)


def _roll_back(deployment: Deployment, generation: int, reason: str) -> None:
    try:
        services.deployment_rollback(
            deployment_id=deployment.pk, failed_generation=generation, reason=reason, source=source()
        )
        restored = _load(deployment.pk)
        _swap_models(restored, launch_spec(restored), model_specs(restored))
        _mark_ready(restored, launch_spec(restored).models, only_from=frozenset({S.UPDATING}))
    except (GantryError, OSError) as exc:
        _fail(
            deployment,
            f"generation {generation} failed ({reason}) and so did the rollback: {exc}",
            only_from=frozenset({S.UPDATING}),
        )


def stop(deployment_id: int) -> None:
    """Stop the deployment's server. It is called stopped once the server is gone
    and NVML shows its processes hold no GPU memory any more."""
    deployment = _load(deployment_id)
    if deployment is None or deployment.status != S.STOPPING:
        return
    message = "tritonserver stopped"
    to = S.STOPPED
    if deployment.runtime_handle:
        runtime = runtime_for(deployment)
        try:
            spec = launch_spec(deployment, model_specs(deployment))
        except PermanentError:
            spec = launch_spec(deployment)
        pids = runtime.pids(deployment.runtime_handle, spec) if spec.gpu_ids else []
        runtime.stop(deployment.runtime_handle, spec)
        holding = _await_gpu_release(list(spec.gpu_ids), pids)
        if holding:
            to = S.FAILED
            message = (
                f"tritonserver stopped, but NVML still shows its processes {sorted(holding)} holding "
                f"{sum(holding.values()) / 2**20:.0f} MiB on GPU(s) {list(spec.gpu_ids)} after "
                f"{settings.GANTRY_GPU_RELEASE_TIMEOUT}s"
            )
    try:
        services.deployment_transition(
            deployment_id=deployment_id,
            to=to,
            source=source(),
            only_from=frozenset({S.STOPPING}),
            runtime_handle="",
            message=message,
        )
    except InvalidTransition:
        log.info("deployment %s left stopping before the stop finished", deployment_id)


def _await_gpu_release(gpu_indexes: list[int], pids: list[int]) -> dict[int, int]:
    """Wait until none of ``pids`` holds memory on ``gpu_indexes``; return those still holding."""
    if not gpu_indexes or not pids:
        return {}
    deadline = time.monotonic() + settings.GANTRY_GPU_RELEASE_TIMEOUT
    while True:
        holding = {pid: used for pid, used in nvml.compute_processes(gpu_indexes).items() if pid in pids}
        if not holding or time.monotonic() >= deadline:
            return holding
        time.sleep(0.5)


def _recent_crash_restarts(deployment: Deployment) -> int:
    since = timezone.now() - timedelta(minutes=10)
    return Event.objects.filter(deployment=deployment, kind="deployment.crash_restart", created_at__gte=since).count()


# A launch task moves its deployment out of launching within seconds; one that
# stays longer was lost with its worker (or its message), and is driven again.
LAUNCH_STALL_S = 60


def reconcile_host(inventory: nvml.Inventory | None = None) -> None:
    """Make this host's deployments match what runs, without waiting on the broker.

    Notices crashed servers (and restarts those that should run), models that
    are not ready, launches lost with a dead worker, and servers that finished
    loading while no task was waiting for them.
    """
    deployments = Deployment.objects.select_related("host").filter(
        host__name=settings.GANTRY_HOST_NAME, status__in=[S.LAUNCHING, S.LOADING, S.READY, S.UPDATING, S.DEGRADED]
    )
    now = timezone.now()
    for deployment in deployments:
        runtime = runtime_for(deployment)
        spec = launch_spec(deployment)
        _ship_log(deployment, runtime, spec)
        if deployment.status == S.LAUNCHING:
            if (now - deployment.status_changed_at).total_seconds() > LAUNCH_STALL_S:
                _redrive_launch(deployment)
        elif not runtime.is_running(deployment.runtime_handle, spec):
            _handle_crash(deployment, runtime, spec)
        elif deployment.status == S.LOADING:
            _check_loading(deployment, runtime, spec, now)
        elif deployment.status == S.UPDATING:
            # Its apply task swaps models in place; one lost with a dead worker is rolled back.
            if (now - deployment.status_changed_at).total_seconds() > settings.GANTRY_TRITON_READY_TIMEOUT + 60:
                _roll_back(_load(deployment.pk), deployment.generation, "the update did not finish in time")
        else:
            _check_models(deployment)
            _collect_metrics(deployment, inventory)
    _remove_unwanted_containers()


# Where each deployment's server log was last read, per server (handle).
_log_cursor: dict[int, tuple[str, float]] = {}


def _ship_log(deployment: Deployment, runtime: Runtime, spec: LaunchSpec) -> None:
    if not deployment.runtime_handle:
        return
    handle, cursor = _log_cursor.get(deployment.pk, ("", None))
    if handle != deployment.runtime_handle:
        cursor = None
    lines, cursor = runtime.read_log(deployment.runtime_handle, spec, cursor)
    _log_cursor[deployment.pk] = (deployment.runtime_handle, cursor)
    services.log_lines_append(deployment_id=deployment.pk, lines=lines)


def _remove_unwanted_containers() -> None:
    """Remove Gantry containers on this host that no deployment wants (any more)."""
    runtime = DockerRuntime(settings.GANTRY_HOST_NAME)
    try:
        containers = runtime.containers()
    except TransientError:
        return  # no Docker engine on this host
    wanted = dict(
        Deployment.objects.filter(
            host__name=settings.GANTRY_HOST_NAME, runtime=DeploymentRuntime.DOCKER, status__in=states.ACTIVE
        ).values_list("pk", "runtime_handle")
    )
    for container in containers:
        handle = wanted.get(container.deployment_id)
        if handle == container.id or (container.deployment_id in wanted and not handle):
            continue  # its deployment's server, or one being started right now
        runtime.stop(container.id, grace_s=10)
        services.record_host_event(
            host_name=settings.GANTRY_HOST_NAME,
            kind="host.container_removed",
            source=source(),
            message=f"removed container {container.name} ({container.id[:12]}): "
            f"no deployment wants it (deployment {container.deployment_id}, generation {container.generation})",
        )


# The previous scrape of each deployment's server (and which server it was),
# to turn cumulative counters into rates.
_last_scrape: dict[int, tuple[str, metrics.Scrape]] = {}


def _gpu_figures(triton: dict[str, dict[str, float]], inventory: nvml.Inventory | None) -> dict[str, dict[str, float]]:
    """Triton's GPU gauges, or NVML's where Triton reads none or only zeros
    (its DCGM-based metrics are missing in some images and containers)."""
    if any(any(values.values()) for values in triton.values()) or inventory is None:
        return triton
    return {
        gpu.uuid: {
            "utilization": gpu.utilization_percent / 100,
            "memory_used_bytes": gpu.memory_used_bytes,
            "memory_total_bytes": gpu.memory_total_bytes,
            "source": "nvml",
        }
        for gpu in inventory.gpus
    }


def _collect_metrics(deployment: Deployment, inventory: nvml.Inventory | None = None) -> None:
    url = f"http://{settings.GANTRY_HOST_ADDRESS}:{deployment.metrics_port}/metrics"
    try:
        current = metrics.scrape(url)
    except TransientError as exc:
        log.info("deployment %s: %s", deployment.pk, exc)
        return
    handle, previous = _last_scrape.get(deployment.pk, ("", None))
    if handle != deployment.runtime_handle:
        previous = None  # another server since: its counters started again from zero
    _last_scrape[deployment.pk] = (deployment.runtime_handle, current)
    services.metrics_record(
        deployment_id=deployment.pk,
        models=metrics.derive(previous, current),
        gpus=_gpu_figures(current.gpus, inventory),
    )


def _redrive_launch(deployment: Deployment) -> None:
    since = timezone.now() - timedelta(seconds=LAUNCH_STALL_S)
    if Event.objects.filter(deployment=deployment, kind="deployment.redrive", created_at__gte=since).exists():
        return
    services.deployment_redrive(
        deployment_id=deployment.pk,
        source=source(),
        message=f"still launching after {LAUNCH_STALL_S}s: its launch task was lost; launching again",
    )


def _readiness(deployment: Deployment) -> Readiness:
    client = _client(deployment)
    try:
        return client.readiness(triton_model_names(deployment.placements.all()))
    finally:
        client.close()


def _mark_ready(
    deployment: Deployment, names: list[str], *, only_from: frozenset[str] = frozenset({S.LOADING})
) -> None:
    services.deployment_transition(
        deployment_id=deployment.pk,
        to=S.READY,
        source=source(),
        only_from=only_from,
        message=f"ready: {', '.join(names)} on port {deployment.http_port}",
    )


def _check_loading(deployment: Deployment, runtime: Runtime, spec: LaunchSpec, now) -> None:  # noqa: ANN001
    """A loading server whose launch task died with its worker: finish the launch's job."""
    state = _readiness(deployment)
    try:
        if state.ready and state.all_models_ready:
            _mark_ready(deployment, list(state.models))
        elif (now - deployment.status_changed_at).total_seconds() > settings.GANTRY_TRITON_READY_TIMEOUT:
            tail = runtime.log_tail(deployment.runtime_handle, spec)
            runtime.stop(deployment.runtime_handle, spec)
            _fail(
                deployment,
                f"tritonserver not ready after {settings.GANTRY_TRITON_READY_TIMEOUT}s",
                tail=tail,
                only_from=frozenset({S.LOADING}),
            )
    except InvalidTransition:
        pass  # the launch task got there first


def _handle_crash(deployment: Deployment, runtime: Runtime, spec: LaunchSpec) -> None:
    tail = runtime.log_tail(deployment.runtime_handle, spec)
    # A crashed container is kept until now for its logs; remove it before any restart.
    runtime.stop(deployment.runtime_handle, spec)
    _fail(
        deployment,
        "tritonserver exited unexpectedly",
        tail=tail,
        only_from=frozenset({S.LOADING, S.READY, S.UPDATING, S.DEGRADED}),
    )
    if deployment.desired_state != DesiredState.RUNNING:
        return
    restarts = _recent_crash_restarts(deployment)
    if restarts >= settings.GANTRY_CRASH_RESTART_LIMIT:
        services.record_deployment_event(
            deployment_id=deployment.pk,
            kind="deployment.crash_loop",
            source=source(),
            message=f"not restarting: {restarts} crash restarts in the last 10 minutes",
        )
        return
    try:
        services.deployment_relaunch(deployment_id=deployment.pk, source=source(), attempt=restarts + 1)
    except InvalidTransition:
        pass


def _check_models(deployment: Deployment) -> None:
    state = _readiness(deployment)
    not_ready = [name for name, ok in state.models.items() if not ok]
    try:
        if not_ready and deployment.status == S.READY:
            services.deployment_transition(
                deployment_id=deployment.pk,
                to=S.DEGRADED,
                source=source(),
                only_from=frozenset({S.READY}),
                message=f"not ready: {', '.join(not_ready)}",
            )
        elif not not_ready and deployment.status == S.DEGRADED:
            services.deployment_transition(
                deployment_id=deployment.pk,
                to=S.READY,
                source=source(),
                only_from=frozenset({S.DEGRADED}),
                message="all models ready again",
            )
    except InvalidTransition:
        pass
