"""The docker runtime, Gantry's one home for the Docker SDK: one container per
deployment, from an allow-listed Triton image.

Containers use host networking (each deployment has its own three ports), a
large shared-memory segment and unlimited locked memory as NVIDIA recommends,
(GANTRY_DOCKER_ULIMITS), the model repository and checkpoints mounted read-only at the same paths, GPUs
by device request, and labels naming the host, the deployment and its
generation, so a restarted agent finds them again. Never privileged.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import docker
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.types import DeviceRequest, Mount, Ulimit

from deployments.errors import PermanentError, TransientError
from workers.runtimes import MAX_LOG_LINES, LaunchSpec, tritonserver_args

log = logging.getLogger(__name__)

LABEL_HOST = "gantry.host"
LABEL_DEPLOYMENT = "gantry.deployment"
LABEL_GENERATION = "gantry.generation"
SHM_SIZE = "2g"  # Docker's 64 MB default is far too small for Triton's python backend and MPI ranks


@dataclass(frozen=True)
class Container:
    id: str
    name: str
    deployment_id: int
    generation: int
    running: bool


def container_name(spec: LaunchSpec) -> str:
    return f"gantry-deployment-{spec.deployment_id}"


def run_options(spec: LaunchSpec, host_name: str) -> dict:
    """Everything ``containers.run`` gets, for review and tests: no free-form flags."""
    mounts = [Mount(target=str(spec.repository), source=str(spec.repository), type="bind", read_only=True)]
    mounts += [Mount(target=str(path), source=str(path), type="bind", read_only=True) for path in spec.read_only_mounts]
    options = {
        "image": spec.image,
        "command": ["tritonserver", *tritonserver_args(spec)],
        "name": container_name(spec),
        "labels": {
            LABEL_HOST: host_name,
            LABEL_DEPLOYMENT: str(spec.deployment_id),
            LABEL_GENERATION: str(spec.generation),
        },
        "network_mode": "host",
        "shm_size": SHM_SIZE,
        "ulimits": [Ulimit(name=name, soft=soft, hard=hard) for name, soft, hard in spec.ulimits],
        "mounts": mounts,
        "environment": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **spec.extra_env},
        "privileged": False,
        "detach": True,
    }
    if spec.gpu_ids:
        options["device_requests"] = [DeviceRequest(device_ids=[str(i) for i in spec.gpu_ids], capabilities=[["gpu"]])]
    return options


def _client() -> docker.DockerClient:
    try:
        return docker.from_env(timeout=30)
    except DockerException as exc:
        raise TransientError(f"Docker engine unreachable: {exc}") from exc


class DockerRuntime:
    """The Runtime interface over the Docker engine of this host."""

    def __init__(self, host_name: str) -> None:
        self.host_name = host_name

    def start(self, spec: LaunchSpec) -> str:
        client = _client()
        try:
            for attempt in range(5):
                # A container of this name left by an earlier attempt is ours: replace it.
                try:
                    client.containers.get(container_name(spec)).remove(force=True)
                except NotFound:
                    pass
                try:
                    container = client.containers.run(**run_options(spec, self.host_name))
                    break
                except APIError as exc:
                    # Docker may still be removing the old container of this name.
                    if exc.status_code != 409 or attempt == 4:
                        raise
                    time.sleep(1)
        except ImageNotFound as exc:
            raise PermanentError(f"image {spec.image} is not on this host: pull or build it first") from exc
        except APIError as exc:
            if exc.is_client_error():
                raise PermanentError(f"Docker refused the container: {exc.explanation}") from exc
            raise TransientError(f"Docker failed to start the container: {exc.explanation}") from exc
        finally:
            client.close()
        log.info("started container %s for deployment %s", container.short_id, spec.deployment_id)
        return container.id

    def _get(self, handle: str):  # noqa: ANN202 - docker's Container
        client = _client()
        try:
            return client.containers.get(handle)
        except NotFound:
            return None
        except APIError as exc:
            raise TransientError(f"Docker: {exc.explanation}") from exc
        finally:
            client.close()

    def is_running(self, handle: str, spec: LaunchSpec) -> bool:
        if not handle:
            return False
        container = self._get(handle)
        return container is not None and container.status == "running"

    def stop(self, handle: str, spec: LaunchSpec | None = None, *, grace_s: int = 30) -> None:
        """Stop and remove the container; returns once it is gone."""
        container = self._get(handle) if handle else None
        if container is None:
            return
        try:
            container.stop(timeout=grace_s)
            container.remove(force=True)
        except NotFound:
            pass
        except APIError as exc:
            raise TransientError(f"Docker could not remove {container.short_id}: {exc.explanation}") from exc

    def log_tail(self, handle: str, spec: LaunchSpec, lines: int = 20) -> str:
        container = self._get(handle) if handle else None
        if container is None:
            return ""
        try:
            return container.logs(tail=lines).decode("utf-8", errors="replace")
        except APIError:
            return ""

    def read_log(self, handle: str, spec: LaunchSpec, cursor: float | None) -> tuple[list[str], float]:
        container = self._get(handle) if handle else None
        now = time.time()
        if container is None:
            return [], cursor or now
        try:
            raw = container.logs(since=cursor, until=now) if cursor is not None else container.logs(tail=50)
        except APIError:
            return [], cursor or now
        return raw.decode("utf-8", errors="replace").splitlines()[-MAX_LOG_LINES:], now

    def pids(self, handle: str, spec: LaunchSpec | None = None) -> list[int]:
        container = self._get(handle) if handle else None
        if container is None or container.status != "running":
            return []
        try:
            top = container.top(ps_args="-eo pid")
        except APIError:
            return []
        return [int(row[0]) for row in top.get("Processes") or [] if row and str(row[0]).isdigit()]

    def containers(self) -> list[Container]:
        """Every container Gantry started on this host, running or not."""
        client = _client()
        try:
            found = client.containers.list(all=True, filters={"label": f"{LABEL_HOST}={self.host_name}"})
        except APIError as exc:
            raise TransientError(f"Docker: {exc.explanation}") from exc
        finally:
            client.close()
        return [
            Container(
                id=c.id,
                name=c.name,
                deployment_id=int(c.labels.get(LABEL_DEPLOYMENT, "0")),
                generation=int(c.labels.get(LABEL_GENERATION, "0")),
                running=c.status == "running",
            )
            for c in found
        ]
