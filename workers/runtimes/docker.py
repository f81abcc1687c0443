"""The docker runtime, Gantry's one home for the Docker SDK: one container per
deployment, from an allow-listed Triton image.

Containers use host networking (each deployment has its own three ports), a
large shared-memory segment and unlimited locked memory as NVIDIA recommends,
(GANTRY_DOCKER_ULIMITS), the model repository and checkpoints mounted read-only at the same paths, GPUs
by device request, and labels naming the host, the deployment and its
generation, so a restarted agent finds them again. Never privileged: the
server runs as the host agent's own user, with no capabilities and no way to
gain any, as the process runtime's server does (see server_user).

Over 450 lines on purpose: serving containers and engine-build containers
share the client, the removal that waits out Docker's 409, device requests
and the no-privileges rules; they are the one place Gantry talks to Docker.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import docker
from django.conf import settings
from docker.auth import INDEX_NAME, resolve_repository_name
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.types import DeviceRequest, Mount, Ulimit
from docker.utils import parse_repository_tag

from common.errors import PermanentError, TransientError
from triton_server.server import STOP_GRACE_S, LaunchSpec, server_command, server_settings
from workers.runtimes.base import MAX_LOG_LINES, ServerExit

log = logging.getLogger(__name__)

LABEL_HOST = "gantry.host"
LABEL_DEPLOYMENT = "gantry.deployment"
LABEL_REPLICA = "gantry.replica"
LABEL_GENERATION = "gantry.generation"
# A build container's /dev/shm: Docker's 64 MB default is far too small for MPI ranks.
BUILD_SHM_SIZE = "2g"


@dataclass(frozen=True)
class Container:
    id: str
    name: str
    deployment_id: int
    replica_id: int
    generation: int
    running: bool


def container_name(spec: LaunchSpec, host_name: str) -> str:
    """The replica's container on this host: named by the host too, since two
    hosts' workers (or two control planes' tests) may share one Docker engine, and
    each database counts replicas from 1."""
    return f"gantry-{host_name}-deployment-{spec.deployment_id}-replica-{spec.replica_id}"


def run_options(spec: LaunchSpec, host_name: str) -> dict:
    """Everything ``containers.run`` gets, for review and tests: no free-form flags."""
    # The deployment's folder, not the repository in it: a new generation's
    # repository is written beside the old one and renamed into place, which a
    # mount of the repository folder itself would never see.
    folder = spec.repository.parent
    mounts = [Mount(target=str(folder), source=str(folder), type="bind", read_only=True)]
    mounts += [Mount(target=str(path), source=str(path), type="bind", read_only=True) for path in spec.read_only_mounts]
    environment = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HOME": "/tmp", **spec.extra_env}
    options = {
        "image": spec.image,
        "command": server_command(spec),
        "name": container_name(spec, host_name),
        "labels": {
            LABEL_HOST: host_name,
            LABEL_DEPLOYMENT: str(spec.deployment_id),
            LABEL_REPLICA: str(spec.replica_id),
            LABEL_GENERATION: str(spec.generation),
        },
        "network_mode": "host",
        # Docker's 64 MB default is far too small for the python backend and MPI ranks.
        "shm_size": f"{spec.shm_size_mib}m",
        "ulimits": [Ulimit(name=name, soft=soft, hard=hard) for name, soft, hard in spec.ulimits],
        "mounts": mounts,
        # HOME: the agent's user has none in the image, and libraries cache under it.
        "environment": environment,
        "user": server_user(),
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "privileged": False,
        "detach": True,
    }
    if spec.gpu_ids:
        options["device_requests"] = device_requests(spec.gpu_ids)
    return options


def server_user() -> str:
    """The container's uid:gid: the host agent's own, which can read the
    admin rule file (mode 0600) in the deployment's folder. A model load may
    carry code. As root in the container that code would hold
    Docker's default capabilities on the host's network (raw sockets: reading
    and forging the host's traffic) and own the container's files. As the
    agent's user, with none, it reads what the agent reads (the repository the
    agent wrote, the checkpoints it inspected) and writes only /tmp and shared
    memory."""
    return f"{os.getuid()}:{os.getgid()}"


def _client() -> docker.DockerClient:
    try:
        return docker.from_env(timeout=30)
    except DockerException as exc:
        raise TransientError(f"Docker engine unreachable: {exc}") from exc


class DockerRuntime:
    """The Runtime interface over the Docker engine of this host. A start pulls
    its allow-listed image first when the host lacks it, telling ``report_pull``
    how far it got."""

    def __init__(
        self, host_name: str, data_dir: Path, report_pull: Callable[[PullProgress], None] | None = None
    ) -> None:
        self.host_name = host_name
        self.data_dir = data_dir
        self.report_pull = report_pull

    def start(self, spec: LaunchSpec) -> str:
        ensure_image(spec.image, self.report_pull)
        client = _client()
        try:
            for attempt in range(5):
                # A container of this name left by an earlier attempt is ours: replace it.
                _remove_and_wait(client, container_name(spec, self.host_name))
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

    def stop(self, handle: str, spec: LaunchSpec | None = None, *, grace_s: int = STOP_GRACE_S) -> None:
        """Stop and remove the container; returns once it is gone."""
        container = self._get(handle) if handle else None
        if container is None:
            return
        client = _client()
        try:
            container.stop(timeout=grace_s)
        except NotFound:
            return
        except APIError as exc:
            if exc.status_code != 409:  # 409: it is being removed already
                raise TransientError(f"Docker could not stop {container.short_id}: {exc.explanation}") from exc
        try:
            _remove_and_wait(client, container.id)
        finally:
            client.close()

    def log_tail(self, handle: str, spec: LaunchSpec, lines: int = 20) -> str:
        container = self._get(handle) if handle else None
        if container is None:
            return ""
        try:
            return container.logs(tail=lines).decode("utf-8", errors="replace")
        except APIError as exc:
            return f"(Docker could not read the container's log: {exc.explanation})"

    def read_log(self, handle: str, spec: LaunchSpec, cursor: float | None) -> tuple[list[str], float]:
        container = self._get(handle) if handle else None
        now = time.time()
        if container is None:
            return [], cursor or now
        try:
            raw = container.logs(since=cursor, until=now) if cursor is not None else container.logs(tail=50)
        except APIError as exc:
            raise TransientError(
                f"Docker could not read the log of container {handle[:12]}: {exc.explanation}"
            ) from exc
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

    def stop_leftovers(self, spec: LaunchSpec) -> list[str]:
        container = self._get(container_name(spec, self.host_name))  # Docker finds a container by its name too
        if container is None:
            return []
        self.stop(container.id, spec)
        return [container.id]

    def exit_of(self, handle: str, spec: LaunchSpec) -> ServerExit:
        """From the stopped container's state (kept until reconcile removes it)."""
        container = self._get(handle) if handle else None
        if container is None:
            return ServerExit(None, unknown_why="its container is gone")
        state = container.attrs.get("State") or {}
        code = state.get("ExitCode")
        # Docker reports a signal death as 128 + the signal number.
        returncode = -(code - 128) if isinstance(code, int) and 128 < code < 160 else code
        return ServerExit(returncode, oom_killed=bool(state.get("OOMKilled")))

    def server_changes(self, handle: str, spec: LaunchSpec) -> list[str]:
        """Why the running container cannot take ``spec`` in place: folders it was not
        started with, other GPUs (Docker numbers a container's GPUs from 0, so a
        move leaves every config the same), another shared-memory size, or other
        server arguments."""
        container = self._get(handle) if handle else None
        if container is None:
            return []
        changes = []
        mounted = {m.get("Source", "") for m in container.attrs.get("Mounts") or []}
        missing = sorted(str(p) for p in spec.read_only_mounts if str(p) not in mounted)
        if missing:
            changes.append(f"it reads {', '.join(missing)}, which the container was not started with")
        host_config = container.attrs.get("HostConfig") or {}
        requested = sorted(int(i) for r in host_config.get("DeviceRequests") or [] for i in r.get("DeviceIDs") or [])
        if requested != sorted(spec.gpu_ids):
            changes.append(f"it runs on GPUs {sorted(spec.gpu_ids)}, the container on {requested}")
        if int(host_config.get("ShmSize") or 0) != spec.shm_size_mib * 2**20:
            changes.append(f"its shared memory is {spec.shm_size_mib} MiB")
        running = server_settings((container.attrs.get("Config") or {}).get("Cmd") or [])
        if running != server_settings(server_command(spec)):
            changes.append("its server arguments differ")
        return changes

    def containers(self) -> list[Container]:
        """Every deployment container Gantry started on this host, running or not."""
        client = _client()
        try:
            # Deployment containers only: build containers carry the host label too.
            labels = [f"{LABEL_HOST}={self.host_name}", LABEL_DEPLOYMENT]
            found = client.containers.list(all=True, filters={"label": labels})
        except APIError as exc:
            raise TransientError(f"Docker: {exc.explanation}") from exc
        finally:
            client.close()
        return [
            Container(
                id=c.id,
                name=c.name,
                deployment_id=int(c.labels.get(LABEL_DEPLOYMENT, "0")),
                replica_id=int(c.labels.get(LABEL_REPLICA, "0")),
                generation=int(c.labels.get(LABEL_GENERATION, "0")),
                running=c.status == "running",
            )
            for c in found
        ]


# --- engine builds ---------------------------------------------------------------

LABEL_BUILD = "gantry.build"


@dataclass(frozen=True)
class BuildContainerSpec:
    """One build step in the builder image: its argv, GPUs and mounts (same path inside as outside)."""

    build_id: int
    step: int
    image: str
    argv: list[str]
    gpu_ids: tuple[int, ...]
    read_only: tuple[str, ...]
    read_write: tuple[str, ...]
    ulimits: tuple[tuple[str, int, int], ...]
    env: dict[str, str]


def build_run_options(spec: BuildContainerSpec, host_name: str) -> dict:
    """Everything ``containers.run`` gets for a build step: GPUs by device request,
    NVIDIA's shm size and ulimits, the checkpoint read-only, the work folders
    read-write, labels tying the container to its build. As the agent's user with
    no capabilities, as a serving container (server_user): the conversion runs
    the checkpoint's code, and the files it writes are the agent's to remove."""
    mounts = [Mount(target=p, source=p, type="bind", read_only=True) for p in spec.read_only]
    mounts += [Mount(target=p, source=p, type="bind", read_only=False) for p in spec.read_write]
    options = {
        "image": spec.image,
        "command": spec.argv,
        "name": f"gantry-build-{spec.build_id}-{spec.step}",
        "labels": {LABEL_HOST: host_name, LABEL_BUILD: str(spec.build_id)},
        "network_mode": "host",
        "shm_size": BUILD_SHM_SIZE,
        "ulimits": [Ulimit(name=name, soft=soft, hard=hard) for name, soft, hard in spec.ulimits],
        "mounts": mounts,
        # HOME: the agent's user has none in the image, and the toolchain caches under it.
        "environment": {"HOME": "/tmp", **spec.env},
        "user": server_user(),
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "privileged": False,
        "detach": True,
    }
    if spec.gpu_ids:
        options["device_requests"] = device_requests(spec.gpu_ids)
    return options


def device_requests(gpu_ids: tuple[int, ...]) -> list[DeviceRequest]:
    """The GPUs a container gets (``--gpus '"device=0,1"'``)."""
    return [DeviceRequest(device_ids=[str(i) for i in gpu_ids], capabilities=[["gpu"]])]


class BuildContainer:
    """A running build step: lines stream from its output, the exit code when done."""

    def __init__(self, spec: BuildContainerSpec, host_name: str) -> None:
        client = _client()
        try:
            _remove_and_wait(client, build_run_options(spec, host_name)["name"])
            self._container = client.containers.run(**build_run_options(spec, host_name))
        except ImageNotFound as exc:
            raise PermanentError(f"builder image {spec.image} is not on this host") from exc
        except APIError as exc:
            raise PermanentError(f"Docker refused the build container: {exc.explanation}") from exc
        finally:
            client.close()
        self.handle = self._container.id

    def stream(self):  # noqa: ANN201 - an iterator of output lines, until the container exits
        client = _client()
        try:
            pending = b""
            for chunk in client.containers.get(self.handle).logs(stream=True, follow=True):
                pending += chunk
                *complete, pending = pending.split(b"\n")
                for raw in complete:
                    yield raw.decode("utf-8", errors="replace").rstrip("\r")
            if pending:
                yield pending.decode("utf-8", errors="replace")
        except NotFound:
            return  # removed (a cancel): its end is told elsewhere
        except APIError as exc:
            # The build goes on (its exit code decides); what it prints from here is not seen.
            yield f"[gantry] Docker stopped streaming this build's log: {exc.explanation}; later lines are missing"
        finally:
            client.close()

    def exit_code(self) -> int | None:
        try:
            self._container.reload()
        except NotFound:
            return -9
        except APIError:
            return None
        if self._container.status in ("exited", "dead"):
            return int(self._container.attrs.get("State", {}).get("ExitCode", -1))
        return None

    def kill(self) -> None:
        remove_container(self.handle)

    def remove(self) -> None:
        remove_container(self.handle)


def remove_container(handle: str) -> None:
    client = _client()
    try:
        _remove_and_wait(client, handle)
    finally:
        client.close()


def _remove_and_wait(client: docker.DockerClient, handle: str, timeout_s: float = 30) -> None:
    """Remove the container ``handle`` (an id or a name) and return once it is gone.
    Docker answers 409 while another removal of it is under way (a reconcile pass,
    a duplicate task): that removal is waited for rather than reported as a failure."""
    try:
        client.containers.get(handle).remove(force=True)
        return
    except NotFound:
        return
    except APIError as exc:
        if exc.status_code != 409:
            raise TransientError(f"Docker could not remove {handle[:12]}: {exc.explanation}") from exc
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            client.containers.get(handle)
        except NotFound:
            return
        time.sleep(0.2)
    raise TransientError(f"Docker was still removing {handle[:12]} after {timeout_s:.0f}s")


def build_containers(host_name: str) -> dict[str, int]:
    """Build containers Gantry started on this host: container id -> build id."""
    client = _client()
    try:
        found = client.containers.list(all=True, filters={"label": [f"{LABEL_HOST}={host_name}", LABEL_BUILD]})
    except APIError as exc:
        raise TransientError(f"Docker: {exc.explanation}") from exc
    finally:
        client.close()
    return {c.id: int(c.labels.get(LABEL_BUILD, "0")) for c in found}


def image_digests(images: list[str]) -> dict[str, str]:
    """The digest of each of ``images`` present on this host (the repo digest where
    it was pulled, else the local image id); absent images are left out.
    TransientError, saying why, when the Docker engine cannot be asked."""
    if not images:
        return {}
    client = _client()
    digests = {}
    try:
        for image in images:
            try:
                found = client.images.get(image)
            except (NotFound, ImageNotFound):
                continue
            repo_digests = found.attrs.get("RepoDigests") or []
            digests[image] = repo_digests[0].rpartition("@")[2] if repo_digests else found.id
    except DockerException as exc:
        raise TransientError(f"Docker engine error while listing images: {exc}") from exc
    finally:
        client.close()
    return digests


@dataclass(frozen=True)
class PullProgress:
    """How far a pull got: bytes of the layers seen so far (each layer's size
    is known once it starts), and layers done of those seen."""

    image: str
    done: int
    total: int
    layers_done: int
    layers: int

    def words(self) -> str:
        share = f" ({100 * self.done / self.total:.0f} %)" if self.total else ""
        return (f"pulling {self.image}: {self.done / 1e6:.0f} of {self.total / 1e6:.0f} MB{share}, "
                f"{self.layers_done} of {self.layers} layers")  # fmt: skip


# The key of GANTRY_REGISTRY_CREDENTIALS for an image that names no registry (Docker's default one).
DEFAULT_REGISTRY = "default"


def registry_of(image: str) -> str:
    """The registry an image reference names, as Docker reads it (DEFAULT_REGISTRY when none)."""
    registry, _ = resolve_repository_name(parse_repository_tag(image)[0])
    return DEFAULT_REGISTRY if registry == INDEX_NAME else registry


def image_pull(image: str, report: Callable[[PullProgress], None] | None = None) -> None:
    """Pull ``image`` onto this host with the credentials this host holds for its
    registry (GANTRY_REGISTRY_CREDENTIALS: never logged nor shown), calling
    ``report`` as layers arrive. PermanentError saying why it could not."""
    repository, tag = parse_repository_tag(image)
    tag = tag or "latest"
    registry = registry_of(image)
    auth = settings.GANTRY_REGISTRY_CREDENTIALS.get(registry)
    client = docker.from_env(timeout=3600)
    layers: dict[str, tuple[int, int, bool]] = {}  # id -> (current, total, done)
    try:
        for event in client.api.pull(repository, tag=tag, stream=True, decode=True, auth_config=auth):
            if "error" in event:
                raise PermanentError(_pull_refusal(image, registry, str(event["error"]), auth is not None))
            layer, status, detail = event.get("id"), event.get("status", ""), event.get("progressDetail") or {}
            if not layer or layer == tag:
                continue
            current, total, done = layers.get(layer, (0, 0, False))
            if status in ("Downloading", "Extracting") and detail.get("total"):
                current, total = max(current, int(detail.get("current", 0))), max(total, int(detail["total"]))
            elif status in ("Download complete", "Pull complete", "Already exists"):
                current, done = total, status != "Download complete" or done
            layers[layer] = (current if status != "Extracting" else total, total, done)
            if report is not None:
                report(PullProgress(image, sum(v[0] for v in layers.values()), sum(v[1] for v in layers.values()),
                                    sum(1 for v in layers.values() if v[2]), len(layers)))  # fmt: skip
    except DockerException as exc:
        raise PermanentError(_pull_refusal(image, registry, str(exc), auth is not None)) from exc
    finally:
        client.close()


def _pull_refusal(image: str, registry: str, error: str, with_credentials: bool) -> str:
    said = f"docker pull {image} failed: {error}"
    refused = ("unauthorized", "authentication required", "no basic auth credentials", "denied", "401")
    if any(word in error.lower() for word in refused):
        said += (
            f" (the credentials this host holds for {registry} in GANTRY_REGISTRY_CREDENTIALS were refused)"
            if with_credentials
            else f" ({registry} wants credentials: give this host GANTRY_REGISTRY_CREDENTIALS for it)"
        )
    return said


def ensure_image(image: str, report: Callable[[PullProgress], None] | None = None) -> bool:
    """Pull ``image`` when this host lacks it, if it is allow-listed
    (GANTRY_ALLOWED_IMAGES or GANTRY_BUILDER_IMAGES); whether it pulled.
    PermanentError for an image not allow-listed or that could not be pulled."""
    if image_digests([image]):
        return False
    if image not in settings.GANTRY_ALLOWED_IMAGES and image not in settings.GANTRY_BUILDER_IMAGES:
        raise PermanentError(f"image {image} is not on this host and not allow-listed: it is never pulled")
    image_pull(image, report)
    return True
