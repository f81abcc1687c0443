"""What every runtime shares: the LaunchSpec a deployment's server is started
from, the Runtime interface, and the host's port probe.

Both runtimes (runtimes.process, runtimes.docker) take the same LaunchSpec and
hand back an opaque handle (a process id, a container id) that Gantry stores
on the deployment.
"""

from __future__ import annotations

import fcntl
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from workers import processes

# The most server log lines the agent ships per deployment and heartbeat.
MAX_LOG_LINES = 500


@dataclass(frozen=True)
class LaunchSpec:
    deployment_id: int
    generation: int
    repository: Path
    models: list[str]
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path
    bind_address: str = "127.0.0.1"
    image: str = ""  # docker only
    gpu_ids: tuple[int, ...] = ()
    ulimits: tuple[tuple[str, int, int], ...] = ()  # docker only: (name, soft, hard)
    read_only_mounts: tuple[Path, ...] = ()  # docker only: folders the models read (checkpoints)
    admin_secret: str = ""  # required by Triton's model-repository and logging APIs
    shm_size_mib: int = 2048  # docker only: the container's /dev/shm
    log_verbose: int = 0  # tritonserver --log-verbose
    extra_env: dict[str, str] = field(default_factory=dict)
    world_size: int = 1  # > 1: one MPI rank per GPU of a multi-GPU engine
    engine_models: list[str] = field(default_factory=list)  # what ranks above 0 load


@dataclass(frozen=True)
class ServerExit:
    """How a server ended, as far as its runtime can tell: a Popen-style return
    code (negative: the signal that killed it; None: not known) and whether the
    kernel's OOM killer ended it."""

    returncode: int | None
    oom_killed: bool = False
    unknown_why: str = ""

    def describe(self) -> str:
        if self.oom_killed:
            return "killed by the kernel's OOM killer (out of memory)"
        if self.returncode is None:
            return f"exit status unknown ({self.unknown_why or 'its runtime did not keep it'})"
        described = processes.describe_exit(self.returncode)
        if self.returncode == -signal.SIGKILL:
            return f"{described} (by a person, or by the kernel's OOM killer when memory ran out)"
        return described

    def as_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"returncode": self.returncode, "oom_killed": self.oom_killed}
        if self.returncode is not None and self.returncode < 0:
            data["signal"] = -self.returncode
        return data


def make_once(folder: Path, done: Callable[[], bool], make: Callable[[], None]) -> None:
    """``make()`` unless ``done()``, under a file lock in ``folder``: what a host
    prepares for its servers (the backends folder, the secret library) is made
    once, whichever of its worker processes asks first."""
    if done():
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done():
            make()


def busy_ports(address: str, ports: list[int]) -> list[int]:
    """The ports among ``ports`` that something on this host already listens on."""
    busy = []
    for port in ports:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
            # As Triton binds: connections of a server that just died linger in
            # TIME_WAIT and must not count as busy; a listener still does.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((address, port))
            except OSError:
                busy.append(port)
    return busy


class Runtime(Protocol):
    def start(self, spec: LaunchSpec) -> str: ...

    def is_running(self, handle: str, spec: LaunchSpec) -> bool: ...

    def stop(self, handle: str, spec: LaunchSpec) -> None: ...

    def log_tail(self, handle: str, spec: LaunchSpec, lines: int = 20) -> str: ...

    def read_log(self, handle: str, spec: LaunchSpec, cursor: float | None) -> tuple[list[str], float]:
        """Server log lines written since ``cursor`` (None: only the recent ones), and the
        next cursor; TransientError, saying why, when the log cannot be read."""
        ...

    def server_changes(self, handle: str, spec: LaunchSpec) -> list[str]:
        """Why the running server cannot take ``spec`` in place (a new server must
        start): in words, none when a reload of the changed models is enough."""
        ...

    def pids(self, handle: str, spec: LaunchSpec) -> list[int]:
        """Host process ids of the server and its children (model stubs, MPI ranks)."""
        ...

    def exit_of(self, handle: str, spec: LaunchSpec) -> ServerExit:
        """How the server behind ``handle``, no longer running, ended."""
        ...

    def stop_leftovers(self, spec: LaunchSpec) -> list[str]:
        """Stop servers of ``spec``'s deployment that no row records (a worker died
        between starting one and recording it); their handles."""
        ...
