"""`gantry check`: what this machine lacks to be a Gantry GPU host, each with
its fix. Every check asks the real thing (the database, Redis, the Docker
engine, NVML, the images, the toolchain, the ports) and none changes anything.
`gantry check --install` first installs what Gantry can install itself (the
allow-listed images, AIPerf); ``gantry join`` runs it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from common import paths

OK, WARN, MISSING = "ok", "warn", "missing"


@dataclass(frozen=True)
class Finding:
    what: str
    state: str  # OK, WARN (works without it, with less) or MISSING (needed)
    detail: str
    fix: str = ""


def _database() -> Finding:
    from django.db import connection

    try:
        connection.ensure_connection()
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        return Finding(
            "database",
            MISSING,
            f"{type(exc).__name__}: {exc}".strip()[:300],
            "set DATABASE_URL to the control plane's PostgreSQL (postgres://user:password@host:5432/gantry)",
        )
    return Finding("database", OK, f"{connection.vendor} at {connection.settings_dict.get('HOST') or 'a local file'}")


def _redis() -> Finding:
    import redis

    client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        return Finding("Redis", MISSING, str(exc)[:300], "set REDIS_URL to the control plane's Redis")
    finally:
        client.close()
    return Finding("Redis", OK, settings.REDIS_URL.rsplit("@", 1)[-1])


def _docker() -> Finding:
    try:
        import docker
    except ImportError:
        return Finding("Docker", WARN, "the docker package is not installed", "pip install 'gantry[worker]'")
    try:
        client = docker.from_env(timeout=5)
        version = client.version().get("Version", "?")
        client.close()
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        return Finding(
            "Docker",
            WARN,
            f"the engine does not answer ({str(exc)[:200]})",
            "install Docker and let this user reach it (the docker group); without it only the process "
            "runtime serves models, and engines cannot be built here",
        )
    return Finding("Docker", OK, f"engine {version}")


def _nvml() -> Finding:
    from workers import nvml

    inventory = nvml.read_inventory()
    if inventory.error:
        return Finding(
            "NVML",
            WARN,
            inventory.error,
            "install the NVIDIA driver; without GPUs, models run on the CPU",
        )
    if not inventory.gpus:
        return Finding("NVML", WARN, "no GPUs", "models on this host run on the CPU")
    names = ", ".join(f"{gpu.index}: {gpu.name}" for gpu in inventory.gpus)
    return Finding("NVML", OK, f"driver {inventory.driver_version}, GPUs {names}")


def _images() -> Finding:
    images = list(dict.fromkeys([*settings.GANTRY_ALLOWED_IMAGES, *settings.GANTRY_BUILDER_IMAGES]))
    if not images:
        return Finding("Triton images", OK, "none allowed (GANTRY_ALLOWED_IMAGES is empty): the process runtime only")
    from common.errors import GantryError
    from workers.runtimes.docker import image_digests

    try:
        present = image_digests(images)
    except GantryError as exc:
        return Finding("Triton images", WARN, str(exc), "start the Docker engine")
    absent = [image for image in images if image not in present]
    if absent:
        return Finding(
            "Triton images",
            MISSING,
            f"not on this host: {', '.join(absent)}",
            f"docker pull {absent[0]} (and each other one) on this host",
        )
    return Finding("Triton images", OK, ", ".join(images))


def _tritonserver() -> Finding:
    from common.errors import PermanentError
    from workers.runtimes.process import triton_binary

    try:
        binary = triton_binary()
    except PermanentError as exc:
        return Finding("tritonserver", WARN, str(exc), "pip install 'gantry[worker]' for the process runtime")
    return Finding("tritonserver", OK, str(binary))


def _hidden_processes(mounts: Path = Path("/proc/mounts")) -> Finding:
    """Whether other users can read this host's command lines, Triton's admin secret among them."""
    try:
        options = next(
            (line.split()[3] for line in mounts.read_text().splitlines() if line.split()[1:2] == ["/proc"]), ""
        )
    except OSError as exc:
        return Finding("/proc hidepid", WARN, f"cannot read {mounts}: {exc}")
    hidden = any(
        option in ("hidepid=2", "hidepid=invisible", "hidepid=1", "hidepid=noaccess") for option in options.split(",")
    )
    if hidden:
        return Finding("/proc hidepid", OK, f"other users cannot read the worker's processes ({options})")
    return Finding(
        "/proc hidepid",
        WARN,
        "every local user can read each process's command line, Triton's admin secret among them",
        "on a host shared with other users: mount -o remount,hidepid=invisible /proc (and in /etc/fstab)",
    )


def _model_user() -> Finding:
    """Whether model code runs apart from the worker (workers.model_user)."""
    from common.errors import PermanentError
    from workers import model_user

    try:
        user = model_user.model_user()
    except PermanentError as exc:
        return Finding("model user", MISSING, str(exc))
    if user is None:
        return Finding(
            "model user",
            WARN,
            "GANTRY_MODEL_USER is empty: model code (a checkpoint's own included) runs as the worker, with its secrets",
            "useradd --system --shell /usr/sbin/nologin gantry-model and set GANTRY_MODEL_USER=gantry-model",
        )
    missing = model_user.missing_capabilities()
    if missing:
        return Finding(
            "model user",
            MISSING,
            f"the worker may not switch to {user.pw_name}: it lacks {', '.join(missing)}",
            "run it from the unit gantry join writes (AmbientCapabilities=), or as root",
        )
    from workers.runtimes import process

    try:
        paths = process.runtime_paths()
    except PermanentError:
        paths = [Path(sys.executable).resolve()]  # no tritonserver here: its own finding says so
    closed = model_user.unreadable([*paths, Path(settings.GANTRY_DATA_DIR)])
    if closed:
        return Finding(
            "model user",
            MISSING,
            f"{user.pw_name} cannot read {', '.join(map(str, closed))}",
            "open the folders above them to other users (chmod o+rx), or install Python and Gantry where it can",
        )
    return Finding("model user", OK, f"model code runs as {user.pw_name} (uid {user.pw_uid}), apart from the worker")


def _aiperf() -> Finding:
    executable = Path(settings.GANTRY_AIPERF)
    if not os.access(executable, os.X_OK):
        return Finding(
            "AIPerf",
            WARN,
            f"{executable} is not there",
            "scripts/ensure-aiperf.sh (or set GANTRY_AIPERF): load tests need it",
        )
    return Finding("AIPerf", OK, str(executable))


def _ports() -> Finding:
    from triton_server.server import LOCAL
    from workers.runtimes.base import busy_ports

    low, high = settings.GANTRY_TRITON_PORT_RANGE
    busy = busy_ports(LOCAL, list(range(low, high + 1)))
    free = high - low + 1 - len(busy)
    if free < 3:
        return Finding(
            "Triton ports",
            MISSING,
            f"{free} of {low}-{high} free on {LOCAL}",
            "set GANTRY_TRITON_PORT_RANGE to a free range (three ports per deployment)",
        )
    return Finding("Triton ports", OK, f"{free} of {low}-{high} free: {free // 3} deployments on {LOCAL}")


CHECKS: list[Callable[[], Finding]] = [
    _database,
    _redis,
    _docker,
    _nvml,
    _images,
    _tritonserver,
    _hidden_processes,
    _model_user,
    _aiperf,
    _ports,
]


def _install_images() -> list[str]:
    images = list(dict.fromkeys([*settings.GANTRY_ALLOWED_IMAGES, *settings.GANTRY_BUILDER_IMAGES]))
    if not images:
        return []
    from common.errors import GantryError
    from workers.runtimes.docker import ensure_image, image_digests

    try:
        absent = [image for image in images if image not in image_digests(images)]
    except GantryError as exc:
        return [f"images not pulled ({', '.join(images)}): {exc}"]
    done = []
    for image in absent:
        try:
            ensure_image(image)  # the path a replica's start takes, with this host's registry credentials
            done.append(f"pulled {image}")
        except GantryError as exc:
            done.append(str(exc))
    return done


def _install_aiperf() -> list[str]:
    executable = Path(settings.GANTRY_AIPERF)
    script = paths.shipped("tools") / "scripts" / "ensure-aiperf.sh"
    if os.access(executable, os.X_OK) or not script.exists() or executable.parent.name != "bin":
        return []
    import subprocess

    done = subprocess.run(["bash", str(script), str(executable.parent.parent)], capture_output=True, text=True)
    if done.returncode != 0:
        return [f"AIPerf not installed: {(done.stderr or done.stdout).strip()[-300:]}"]
    return [f"installed AIPerf in {executable.parent.parent}"]


def install_missing() -> list[str]:
    """Install what is missing and Gantry can install: the allow-listed Triton and
    builder images (docker pull) and AIPerf (scripts/ensure-aiperf.sh). What was done, or why not."""
    return [*_install_images(), *_install_aiperf()]


def run_checks() -> list[Finding]:
    """Every check, in order; one that raises is itself a finding."""
    found = []
    for check in CHECKS:
        try:
            found.append(check())
        except Exception as exc:  # noqa: BLE001 - the report must go on
            found.append(Finding(check.__name__.strip("_"), MISSING, f"{type(exc).__name__}: {exc}"[:300]))
    return found
