"""What a tritonserver is started from (LaunchSpec) and its command line,
whatever runs it (a local process, a container, MPI ranks): explicit model
control, the deployment's own ports on loopback, and the admin APIs
restricted to Gantry's per-deployment secret.

The secret is on the command line: tritonserver takes its restricted-API
rule only there. Other machines cannot reach the server at all (it binds
loopback; the host's channel forwards only the web tier), and a host
shared with other users hides processes' command lines with hidepid on
/proc, which ``gantry check`` looks for (docs/security.md says why this
replaced the library that used to swap the secret in after start)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from triton_server.client import ADMIN_HEADER

# On SIGTERM tritonserver waits this long for open client connections (a
# keep-alive connection of the gateway, say) before it exits; its default of
# 30 s made every stop wait 30 s. Gantry's own stop waits STOP_GRACE_S before
# SIGKILL, so the two never race.
EXIT_TIMEOUT_S = 5
STOP_GRACE_S = EXIT_TIMEOUT_S + 15


# Where every Triton server listens: HTTP, gRPC and metrics on loopback only.
# Other machines reach a host's servers through its channel (workers.channel).
LOCAL = "127.0.0.1"


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
    bind_address: str = LOCAL
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
    replica_id: int = 0  # the replica this server is (0: none recorded, as in a bench)


def restricted_api_args(secret: str) -> list[str]:
    """The model-repository and logging APIs restricted to requests carrying ``secret``."""
    if not secret:
        return []
    rule = f"model-repository,logging:{ADMIN_HEADER}={secret}"
    return [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]


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
        f"--log-verbose={spec.log_verbose}",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        *restricted_api_args(spec.admin_secret),
    ]


def server_settings(argv: list[str]) -> list[str]:
    """What a server was started with beyond the models it loads (and where the
    host keeps its backends): a new generation that changes any of it needs a
    new server."""
    return [arg for arg in argv if not arg.startswith(("--load-model=", "--backend-directory="))]


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
                f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            ]
        shm = f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"
        command += ["-n", "1", "tritonserver", *args, "--disable-auto-complete-config", shm]
        if rank < spec.world_size - 1:
            command.append(":")
    return command
