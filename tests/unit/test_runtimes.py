import socket
from pathlib import Path

from workers.runtimes import LaunchSpec, busy_ports, tritonserver_args


def test_busy_ports_finds_a_listening_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        assert busy_ports("127.0.0.1", [taken, free]) == [taken]


def test_repository_and_logging_apis_are_restricted_by_the_secret():
    spec = LaunchSpec(
        deployment_id=1,
        generation=1,
        repository=Path("/r"),
        models=["m"],
        http_port=1,
        grpc_port=2,
        metrics_port=3,
        log_path=Path("/l"),
        admin_secret="s3cret",
    )
    args = tritonserver_args(spec)
    assert "--http-restricted-api=model-repository,logging:gantry-admin-key=s3cret" in args
    assert "--grpc-restricted-protocol=model-repository,logging:gantry-admin-key=s3cret" in args
