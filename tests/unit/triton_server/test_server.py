"""tritonserver's command line: loopback, restricted admin APIs (checked on a
real server, the pytriton wheel's), MPI ranks."""

from __future__ import annotations

from pathlib import Path

import requests

from tests import factories
from tests.integration.conftest import free_ports, wait_for
from triton_server.server import LOCAL, LaunchSpec, server_command, tritonserver_args
from workers.runtimes import process


def test_a_real_server_binds_loopback_and_answers_its_admin_apis_only_with_the_secret(tmp_path: Path):
    (tmp_path / "repository").mkdir()
    port = free_ports(3)
    spec = factories.launch_spec(
        tmp_path, models=[], http_port=port, grpc_port=port + 1, metrics_port=port + 2, admin_secret="s3cret-value"
    )
    assert spec.bind_address == LOCAL
    handle = process.start(spec, data_dir=tmp_path)  # as the process runtime starts every server
    try:
        index = f"http://127.0.0.1:{spec.http_port}/v2/repository/index"
        wait_for(lambda: _answers(f"http://127.0.0.1:{spec.http_port}/v2/health/live"), 30, "tritonserver")
        assert requests.post(index, timeout=5).status_code == 403
        assert requests.post(index, headers={"gantry-admin-key": "guessed"}, timeout=5).status_code == 403
        assert requests.post(index, headers={"gantry-admin-key": "s3cret-value"}, timeout=5).status_code == 200
        environ = Path(f"/proc/{handle}/environ").read_bytes()
        assert b"s3cret-value" not in environ  # what model stubs inherit
    finally:
        process.stop(handle, spec.repository, grace_s=10)


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=1).ok
    except requests.ConnectionError:
        return False


def test_multi_gpu_engine_runs_one_mpi_rank_per_gpu():
    spec = factories.launch_spec(
        models=["llama-engine", "llama"], http_port=18000, world_size=2, engine_models=["llama-engine"]
    )
    command = server_command(spec)
    assert command[:2] == ["mpirun", "--allow-run-as-root"]
    ranks = " ".join(command[2:]).split(" : ")
    assert len(ranks) == 2
    assert "--load-model=llama" in ranks[0] and "--http-port=18000" in ranks[0]
    assert "shm-region-prefix-name=prefix0_" in ranks[0] and "shm-region-prefix-name=prefix1_" in ranks[1]
    assert "--load-model=llama-engine" in ranks[1] and "--load-model=llama " not in ranks[1] + " "
    assert "--allow-http=false" in ranks[1] and "--http-port" not in ranks[1]
    single = server_command(LaunchSpec(**{**spec.__dict__, "world_size": 1}))
    assert single[0] == "tritonserver"


def test_a_stopping_server_waits_briefly_for_open_connections_and_gantry_outwaits_it():
    from triton_server import server
    from workers.runtimes import docker, process

    args = tritonserver_args(factories.launch_spec())
    assert f"--exit-timeout-secs={server.EXIT_TIMEOUT_S}" in args
    # Gantry's TERM-then-KILL must not race Triton's own orderly exit.
    assert process.stop.__kwdefaults__["grace_s"] > server.EXIT_TIMEOUT_S
    assert docker.DockerRuntime.stop.__kwdefaults__["grace_s"] > server.EXIT_TIMEOUT_S
    ranks = " ".join(server_command(factories.launch_spec(world_size=2, engine_models=["e"]))).split(" : ")
    assert all(f"--exit-timeout-secs={server.EXIT_TIMEOUT_S}" in rank for rank in ranks)
