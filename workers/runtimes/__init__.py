"""Where a deployment's Triton server runs: a local process or a Docker container.

Both runtimes take the same LaunchSpec and hand back an opaque handle (a
process id, a container id) that Gantry stores on the deployment.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from workers.triton.client import ADMIN_HEADER

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
    extra_env: dict[str, str] = field(default_factory=dict)
    world_size: int = 1  # > 1: one MPI rank per GPU of a multi-GPU engine
    engine_models: list[str] = field(default_factory=list)  # what ranks above 0 load


def tritonserver_args(spec: LaunchSpec) -> list[str]:
    """tritonserver's arguments for ``spec``, whatever the runtime: explicit model
    control with every model loaded at start, and the deployment's own ports."""
    return [
        f"--model-repository={spec.repository}",
        "--model-control-mode=explicit",
        *[f"--load-model={name}" for name in spec.models],
        f"--http-address={spec.bind_address}",
        f"--http-port={spec.http_port}",
        f"--grpc-address={spec.bind_address}",
        f"--grpc-port={spec.grpc_port}",
        f"--metrics-address={spec.bind_address}",
        f"--metrics-port={spec.metrics_port}",
        "--allow-metrics=true",
        "--log-verbose=0",
        *restricted_api_args(spec.admin_secret),
    ]


def server_command(spec: LaunchSpec) -> list[str]:
    """The server's command line. A multi-GPU engine runs under MPI with one
    tritonserver per rank, as tensorrtllm_backend's launch_triton_server.py
    does: rank 0 serves every model on the deployment's ports; the other ranks
    load only the engine models and open no ports (they would collide under
    host networking); each rank gets its own python-backend shared-memory prefix."""
    if spec.world_size <= 1:
        return ["tritonserver", *tritonserver_args(spec)]
    command = ["mpirun", "--allow-run-as-root"]
    for rank in range(spec.world_size):
        if rank == 0:
            args = tritonserver_args(spec)
        else:
            args = [
                f"--model-repository={spec.repository}",
                "--model-control-mode=explicit",
                *[f"--load-model={name}" for name in spec.engine_models],
                "--allow-http=false",
                "--allow-grpc=false",
                "--allow-metrics=false",
            ]
        shm = f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"
        command += ["-n", "1", "tritonserver", *args, "--disable-auto-complete-config", shm]
        if rank < spec.world_size - 1:
            command.append(":")
    return command


def restricted_api_args(secret: str) -> list[str]:
    if not secret:
        return []
    rule = f"model-repository,logging:{ADMIN_HEADER}={secret}"
    return [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]


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
        """Server log lines written since ``cursor`` (None: only the recent ones), and the next cursor."""
        ...

    def pids(self, handle: str, spec: LaunchSpec) -> list[int]:
        """Host process ids of the server and its children (model stubs, MPI ranks)."""
        ...
