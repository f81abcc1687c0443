"""A replica's jobs on its host: launch its Triton server and wait for its
models, apply a new generation in place (rolling back if it fails), and stop it.

Each job runs under workers.jobs.run_job, which turns a failure into the
replica's failed state with its reason. Every status change goes through
deployments.states; every step re-reads the row, so a task delivered twice, or
one racing a stop, ends in the state the database asks for.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.utils import timezone

from common.errors import GantryError, InvalidTransition, PermanentError, TransientError
from deployments import states
from deployments.models import Deployment, Replica
from deployments.models import DeploymentStatus as S
from deployments.services import builds, downloads, generations, replicas
from triton_server.config import CONFIG_FILE
from triton_server.repository import ModelSpec, write_repository
from triton_server.server import LaunchSpec
from workers import channel, model_user, nvml
from workers.deploy.drain import drain
from workers.deploy.plan import (
    THREAD_VARIABLES,
    current_status,
    deployment_root,
    launch_spec,
    load,
    missing_inputs,
    model_specs,
    runtime_for,
    triton_client,
)
from workers.jobs import JobFailed, run_job, source
from workers.runtimes.base import Runtime, busy_ports

log = logging.getLogger(__name__)


def failer(replica_id: int, only_from: frozenset[str]):  # noqa: ANN201 - a workers.jobs.Fail
    """The ``fail`` of a replica job: failed with the reason (and the server's
    log tail), if the replica is still in one of ``only_from``."""

    def fail(reason: str, *, status: str | None, details: dict[str, Any]) -> None:
        replicas.replica_fail(
            replica_id=replica_id,
            reason=reason,
            source=source(),
            only_from=only_from,
            log_tail=details.get("log_tail", ""),
            server_exit=details.get("exit"),
        )

    return fail


def mark_ready(replica: Replica, names: list[str], *, from_status: str = S.LOADING) -> None:
    """The replica's server has ``names`` ready at its deployment's generation now."""
    replicas.replica_ready(
        replica_id=replica.pk,
        source=source(),
        from_status=from_status,
        generation=replica.deployment.generation,
        message=f"ready: {', '.join(names)} on port {replica.http_port}",
    )


# --- launch -------------------------------------------------------------------------


def launch(replica_id: int) -> None:
    """Start the replica's Triton server and wait until every model is ready."""
    run_job("launch", lambda: _launch(replica_id), fail=failer(replica_id, frozenset({S.LAUNCHING, S.LOADING})))


@contextmanager
def host_lock(replica_id: int, what: str = "server") -> Iterator[None]:
    """Held by whichever of this host's processes is starting or stopping the
    replica's server (``what``: "server"), or applying a generation to it
    ("generation"): a task sent twice (a re-drive after a broker restart, a
    redelivery) waits for the first, then finds the row moved on. Apart, so a
    stop never waits for a long model load."""
    with open(_lock_path(replica_id, what), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def host_lock_held(replica_id: int, what: str = "server") -> bool:
    """Whether a process of this host holds ``host_lock(replica_id, what)`` now
    (a lock dies with its process, so a task killed mid-way holds none)."""
    with open(_lock_path(replica_id, what), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
        return False


def _lock_path(replica_id: int, what: str) -> Path:
    locks = settings.GANTRY_DATA_DIR / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    return locks / f"replica-{replica_id}-{what}.lock"


def _launch(replica_id: int) -> None:
    with host_lock(replica_id):
        started = _start_server(replica_id)
    if started is not None:
        _await_ready(*started)


def _start_server(replica_id: int) -> tuple[Replica, Runtime, str, LaunchSpec] | None:
    """Start the server of a launching replica and move it to loading."""
    replica = load(replica_id)
    if replica is None or replica.status != S.LAUNCHING:
        log.info("launch of %s skipped: status is %s", replica_id, replica and replica.status)
        return None
    if not downloads.replica_files_here(replica=replica, source=source()):
        return None  # placed here without a hub model's files: its download launches it again
    if problem := inputs_problem(replica):
        raise PermanentError(problem)
    runtime = runtime_for(replica)
    specs = model_specs(replica)
    spec = launch_spec(replica)
    if replica.runtime_handle and runtime.is_running(replica.runtime_handle, spec):
        # A redelivered task: the server from the first delivery still runs.
        runtime.stop(replica.runtime_handle, spec)
    leftovers = runtime.stop_leftovers(spec)
    if leftovers:
        replicas.record_replica_event(
            replica_id=replica_id,
            kind="deployment.leftover_stopped",
            source=source(),
            message=f"stopped tritonserver {', '.join(h[:12] for h in leftovers)}, which a worker that died "
            "had started without recording it; starting a fresh one",
        )
    busy = busy_ports(spec.bind_address, [spec.http_port, spec.grpc_port, spec.metrics_port])
    if busy:
        raise PermanentError(
            f"port(s) {', '.join(map(str, busy))} on {settings.GANTRY_HOST_NAME} are already in use "
            "by another program; give the replica other ports"
        )
    write_repository(spec.repository, specs)
    channel.allow(replica.host_id)  # the host's channel forwards to the new server's port
    handle = runtime.start(spec)
    try:
        states.replica_transition(
            replica_id=replica_id,
            to=S.LOADING,
            source=source(),
            only_from=frozenset({S.LAUNCHING}),
            runtime_handle=handle,
            threads=int(spec.extra_env[THREAD_VARIABLES[0]]),
            message=f"tritonserver ({replica.deployment.runtime} {handle[:12]}) loading {', '.join(spec.models)}, "
            f"{spec.extra_env[THREAD_VARIABLES[0]]} thread(s) per model process",
        )
    except InvalidTransition:
        # Stopped while we were starting: undo our own start.
        runtime.stop(handle, spec)
        return None
    return replica, runtime, handle, spec


def inputs_problem(replica: Replica) -> str | None:
    """What the replica reads that is not on this host, in words (an engine
    found gone or changed is marked so, and never reused); None when all is here."""
    missing = missing_inputs(replica)
    for item in missing:
        if item.build_id is not None:
            builds.build_files_missing(build_id=item.build_id, problem=item.problem, source=source())
    return "; ".join(item.describe() for item in missing) or None


def _await_ready(
    replica: Replica, runtime: Runtime, handle: str, spec: LaunchSpec, *, status: str = S.LOADING, what: str = ""
) -> None:
    """Wait until the server just started has every model ready, then mark the
    replica ready from ``status``. If the server dies or times out, stop it
    and end the job failed with its last log lines (``what`` says which job)."""

    def keep_waiting() -> bool:
        return runtime.is_running(handle, spec) and current_status(replica.pk) == status

    client = triton_client(replica)
    try:
        client.wait_until_ready(spec.models, timeout_s=settings.GANTRY_TRITON_READY_TIMEOUT, keep_waiting=keep_waiting)
    except PermanentError:
        if current_status(replica.pk) != status:
            return  # stopped or failed elsewhere; the stop task owns the server now
        tail = runtime.log_tail(handle, spec)
        ended = runtime.exit_of(handle, spec)
        runtime.stop(handle, spec)
        raise JobFailed(
            f"{what}tritonserver exited while loading: {ended.describe()}", log_tail=tail, exit=ended.as_data()
        ) from None
    except TransientError as exc:
        tail = runtime.log_tail(handle, spec)
        runtime.stop(handle, spec)
        raise JobFailed(f"{what}tritonserver {exc}", log_tail=tail) from exc
    finally:
        client.close()
    try:
        mark_ready(replica, spec.models, from_status=status)
    except InvalidTransition:
        log.info("replica %s left %s before it became ready", replica.pk, status)


# --- a new generation, in place ---------------------------------------------------


def _configs(repository: Path) -> dict[str, str]:
    if not repository.is_dir():
        return {}
    return {d.name: (d / CONFIG_FILE).read_text() for d in repository.iterdir() if (d / CONFIG_FILE).is_file()}


def swap_models(replica: Replica, spec: LaunchSpec, specs: list[ModelSpec]) -> dict[str, list[str]]:
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
    client = triton_client(replica)
    try:
        for name in plan["unloaded"]:
            client.unload(name)
        for name in plan["loaded"]:
            client.load(name)
        client.wait_until_ready(sorted(after), timeout_s=settings.GANTRY_TRITON_READY_TIMEOUT, server_ready=False)
    finally:
        client.close()
    return plan


def apply_generation(replica_id: int, generation: int) -> None:
    """Apply a ready replica's new generation in place; roll back if it fails."""
    run_job(
        f"generation {generation}",
        lambda: _apply_generation(replica_id, generation),
        fail=failer(replica_id, frozenset({S.UPDATING})),
    )


def _apply_generation(replica_id: int, generation: int) -> None:
    with host_lock(replica_id, "generation"):
        _apply_generation_once(replica_id, generation)


def _apply_generation_once(replica_id: int, generation: int) -> None:
    replica = load(replica_id)
    if replica is None or replica.status != S.UPDATING or replica.deployment.generation != generation:
        return
    if problem := inputs_problem(replica):
        roll_back(replica, generation, problem)
        return
    spec = launch_spec(replica)
    runtime = runtime_for(replica)
    changes = runtime.server_changes(replica.runtime_handle, spec)
    if changes:
        why = f"generation {generation} needs a new server: {'; '.join(changes)}"
        surge = replicas.replica_surge(replica_id=replica.pk, generation=generation, why=why, source=source())
        if surge is None and current_status(replica.pk) == S.UPDATING:  # no room: max unavailable 1
            _restart_for_generation(replica, runtime, spec, generation, changes)
        return
    try:
        plan = swap_models(replica, spec, model_specs(replica))
    except GantryError as exc:
        roll_back(replica, generation, str(exc))
        return
    replicas.record_replica_event(
        replica_id=replica.pk,
        kind="deployment.generation_applied",
        source=source(),
        message=f"generation {generation}: loaded {plan['loaded'] or 'none'}, unloaded {plan['unloaded'] or 'none'}, "
        f"left as they were {plan['unchanged'] or 'none'}",
    )
    try:
        mark_ready(replica, spec.models, from_status=S.UPDATING)
    except InvalidTransition:
        log.info("replica %s left updating while its generation %s was applied", replica.pk, generation)


def _restart_for_generation(
    replica: Replica, runtime: Runtime, spec: LaunchSpec, generation: int, changes: list[str]
) -> None:
    """A running server cannot be given new folders, GPUs or arguments: start a
    new one for the generation (the old one stops first, so the ports are free).
    If the new one does not come up, the previous generation is put back and
    started again the same way."""
    replicas.record_replica_event(
        replica_id=replica.pk,
        kind="deployment.generation_restart",
        source=source(),
        message=f"generation {generation} needs a new server ({'; '.join(changes)}): restarting its server",
    )
    # Updating is not answering: it left balancing when the roll reached it.
    seconds = replica.deployment.drain_timeout_s
    drain(replica, timezone.now() + timedelta(seconds=seconds) if seconds else None, why="restarting in place")
    runtime.stop(replica.runtime_handle, spec)
    try:
        _replace_server(replica, runtime, spec, what=f"generation {generation}: ")
    except JobFailed as failed:
        if current_status(replica.pk) != S.UPDATING:
            raise  # stopped meanwhile: nothing to put back
        _restart_previous(replica, generation, failed)


def _replace_server(replica: Replica, runtime: Runtime, spec: LaunchSpec, *, what: str) -> None:
    write_repository(spec.repository, model_specs(replica))
    handle = runtime.start(spec)
    if not replicas.replica_server_replaced(replica_id=replica.pk, runtime_handle=handle):
        runtime.stop(handle, spec)  # stopped meanwhile: the stop task owns the replica now
        return
    _await_ready(replica, runtime, handle, spec, status=S.UPDATING, what=what)


def _restart_previous(replica: Replica, generation: int, failed: JobFailed) -> None:
    """The new server of ``generation`` failed and is stopped: put the previous
    generation back and start its server; JobFailed when even that fails."""
    try:
        generations.deployment_rollback(
            deployment_id=replica.deployment_id, failed_generation=generation, reason=failed.reason, source=source()
        )
        restored = load(replica.pk)
        _replace_server(
            restored, runtime_for(restored), launch_spec(restored), what=f"rolling back from generation {generation}: "
        )
    except JobFailed as again:
        raise JobFailed(
            f"generation {generation} failed ({failed.reason}) and so did the rollback: {again.reason}", **again.details
        ) from again
    except (GantryError, OSError) as exc:
        raise JobFailed(
            f"generation {generation} failed ({failed.reason}) and so did the rollback: {exc}", **failed.details
        ) from exc


def roll_back(replica: Replica, generation: int, reason: str) -> None:
    """Put the generation before ``generation`` back, in the database and in the
    running server; JobFailed when even that fails."""
    try:
        generations.deployment_rollback(
            deployment_id=replica.deployment_id, failed_generation=generation, reason=reason, source=source()
        )
        restored = load(replica.pk)
        swap_models(restored, launch_spec(restored), model_specs(restored))
        mark_ready(restored, launch_spec(restored).models, from_status=S.UPDATING)
    except (GantryError, OSError) as exc:
        raise JobFailed(f"generation {generation} failed ({reason}) and so did the rollback: {exc}") from exc


# --- stop ---------------------------------------------------------------------------


def stop(replica_id: int) -> None:
    """Stop the replica's server. It is called stopped once the server is gone
    and NVML shows its processes hold no GPU memory any more."""
    run_job("stop", lambda: _stop(replica_id), fail=failer(replica_id, frozenset({S.STOPPING})))


def _stop(replica_id: int) -> None:
    with host_lock(replica_id):
        stopped = _stop_server(replica_id)
    if stopped:
        # A restart stops with "running" still desired: start it again.
        replicas.replica_start_after_stop(replica_id=replica_id, source=source())


def _stop_server(replica_id: int) -> bool:
    """Stop a stopping replica's server; whether this call moved it on."""
    replica = load(replica_id)
    if replica is None or replica.status != S.STOPPING:
        return False
    message = "tritonserver stopped"
    to = S.STOPPED
    if replica.runtime_handle:
        drain(replica, replica.drain_until, why="stopping")
        runtime = runtime_for(replica)
        spec = launch_spec(replica)
        pids = runtime.pids(replica.runtime_handle, spec) if spec.gpu_ids else []
        runtime.stop(replica.runtime_handle, spec)
        holding = _await_gpu_release(list(spec.gpu_ids), pids)
        if holding:
            to = S.FAILED
            message = (
                f"tritonserver stopped, but NVML still shows its processes {sorted(holding)} holding "
                f"{sum(holding.values()) / 2**20:.0f} MiB on GPU(s) {list(spec.gpu_ids)} after "
                f"{settings.GANTRY_GPU_RELEASE_TIMEOUT}s"
            )
    try:
        states.replica_transition(
            replica_id=replica_id,
            to=to,
            source=source(),
            only_from=frozenset({S.STOPPING}),
            runtime_handle="",
            message=message,
        )
    except InvalidTransition:
        log.info("replica %s left stopping before the stop finished", replica_id)
        return False
    return True


def forget(deployment_id: int, name: str, serial: int | None = None) -> None:
    """Remove what a deleted deployment left on this host (its repository and
    log), or with ``serial`` what one removed replica of it left."""
    root = deployment_root(deployment_id, name)
    if serial is not None:
        if Replica.objects.filter(deployment_id=deployment_id, serial=serial).exists():
            return  # not removed after all (a stale message): keep its files
        root = root / f"r{serial}"
    elif Deployment.objects.filter(pk=deployment_id).exists():
        return  # not deleted after all (a stale message): keep its files
    if root.exists():
        model_user.remove_folders(root)
        shutil.rmtree(root)
        log.info("removed %s of %s", root, name)


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
