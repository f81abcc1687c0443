"""tritonserver's command line: restricted admin APIs, MPI ranks."""

from __future__ import annotations

from tests import factories
from triton_server.server import LaunchSpec, server_command, tritonserver_args


def test_repository_and_logging_apis_are_restricted_by_a_token_not_the_secret():
    spec = factories.launch_spec(admin_secret="s3cret")
    args = tritonserver_args(spec)
    assert "--http-restricted-api=@gantry-admin-rule@" in args
    assert "--grpc-restricted-protocol=@gantry-admin-rule@" in args
    assert not [arg for arg in args if "s3cret" in arg]


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
