"""The docker runtime's container options (no Docker engine needed)."""

from __future__ import annotations

import os
from pathlib import Path

from tests import factories
from triton_server.server import LaunchSpec
from workers.runtimes.docker import BuildContainerSpec, build_run_options, run_options


def _spec(**overrides) -> LaunchSpec:  # noqa: ANN003
    values = {
        "generation": 3,
        "models": ["minilm", "rerank"],
        "http_port": 18000,
        "grpc_port": 18001,
        "metrics_port": 18002,
        "image": "gantry/tritonserver-test:abc",
        "read_only_mounts": (Path("/models/minilm"),),
        "ulimits": (("memlock", -1, -1), ("stack", 67108864, 67108864)),
    }
    return factories.launch_spec(Path("/data/deployments/7-x"), **{**values, **overrides})


def test_container_is_host_networked_labelled_and_read_only():
    options = run_options(_spec(), host_name="gpu-01")
    assert options["network_mode"] == "host"
    assert options["privileged"] is False
    # Least privilege: the agent's own user, no capabilities, none to gain.
    assert options["user"] == f"{os.getuid()}:{os.getgid()}"
    assert options["cap_drop"] == ["ALL"]
    assert options["security_opt"] == ["no-new-privileges"]
    assert options["environment"]["HOME"] == "/tmp"
    assert options["labels"] == {
        "gantry.host": "gpu-01",
        "gantry.deployment": "7",
        "gantry.replica": "0",
        "gantry.generation": "3",
    }
    assert options["name"] == "gantry-gpu-01-deployment-7-replica-0"
    # Another host's worker on the same engine (or another test process) names its deployment 7 apart.
    assert run_options(_spec(), host_name="gpu-02")["name"] != options["name"]
    assert options["shm_size"] == "2048m"
    assert {(u["Name"], u["Soft"], u["Hard"]) for u in options["ulimits"]} == {
        ("memlock", -1, -1),
        ("stack", 67108864, 67108864),
    }
    assert [(m["Source"], m["Target"], m["ReadOnly"]) for m in options["mounts"]] == [
        # The deployment folder, so a repository renamed into place is seen inside.
        ("/data/deployments/7-x", "/data/deployments/7-x", True),
        ("/models/minilm", "/models/minilm", True),
    ]
    command = options["command"]
    assert command[0] == "tritonserver"
    assert "--model-control-mode=explicit" in command
    assert [a for a in command if a.startswith("--load-model=")] == ["--load-model=minilm", "--load-model=rerank"]
    assert "--http-port=18000" in command and "--metrics-port=18002" in command
    assert "device_requests" not in options


def test_the_secret_restricts_the_admin_apis_and_stays_out_of_the_environment():
    spec = _spec(admin_secret="s3cret", extra_env={"LD_PRELOAD": "/usr/lib/libtcmalloc.so"})
    options = run_options(spec, "gpu-01")
    rule = "model-repository,logging:gantry-admin-key=s3cret"
    assert f"--http-restricted-api={rule}" in options["command"]
    assert f"--grpc-restricted-protocol={rule}" in options["command"]
    assert "s3cret" not in repr(options["environment"])  # model stubs inherit the environment, not argv
    assert options["environment"]["LD_PRELOAD"] == "/usr/lib/libtcmalloc.so"


def test_gpus_go_through_device_requests():
    options = run_options(_spec(gpu_ids=(0, 2)), host_name="gpu-01")
    [request] = options["device_requests"]
    assert request["DeviceIDs"] == ["0", "2"]
    assert request["Capabilities"] == [["gpu"]]


class _Inspected:
    """What ``docker inspect`` holds of a container started with ``options`` (the SDK object's attrs)."""

    def __init__(self, options: dict) -> None:
        requests_ = options.get("device_requests") or []
        self.attrs = {
            "Mounts": [{"Source": m["Source"], "Destination": m["Target"]} for m in options["mounts"]],
            "HostConfig": {
                "DeviceRequests": [{"DeviceIDs": r["DeviceIDs"]} for r in requests_],
                "ShmSize": int(options["shm_size"].removesuffix("m")) * 2**20,
            },
            "Config": {"Cmd": options["command"]},
        }


def test_a_generation_that_moves_gpus_or_changes_the_server_needs_a_new_container(monkeypatch, tmp_path):
    """Docker numbers a container's GPUs from 0, so a model moved from GPU 0 to GPU 1
    writes the same configs: only the container's device request tells."""
    from workers.runtimes.docker import DockerRuntime

    running = _spec(gpu_ids=(0,))
    runtime = DockerRuntime("gpu-01", tmp_path)
    monkeypatch.setattr(runtime, "_get", lambda handle: _Inspected(run_options(running, "gpu-01")))
    assert runtime.server_changes("c1", running) == []
    assert runtime.server_changes("c1", _spec(gpu_ids=(1,))) == ["it runs on GPUs [1], the container on [0]"]
    assert runtime.server_changes("c1", _spec(gpu_ids=(0,), shm_size_mib=16384)) == ["its shared memory is 16384 MiB"]
    assert runtime.server_changes("c1", _spec(gpu_ids=(0,), log_verbose=1)) == ["its server arguments differ"]
    assert runtime.server_changes("c1", _spec(gpu_ids=(0,), models=["other"])) == []  # a reload is enough
    moved = _spec(gpu_ids=(0,), read_only_mounts=(Path("/models/minilm"), Path("/models/new")))
    assert runtime.server_changes("c1", moved) == ["it reads /models/new, which the container was not started with"]


def test_a_build_container_runs_as_the_agent_with_no_capabilities():
    """The conversion runs the checkpoint's code: no more privilege than a serving
    container, and its files are the agent's to remove (forget)."""
    spec = BuildContainerSpec(
        build_id=4, step=1, image="builder", argv=["trtllm-build"], gpu_ids=(), read_only=("/models/x",),
        read_write=("/data/builds/4",), ulimits=(), env={"GANTRY_BUILD_ID": "4"},
    )  # fmt: skip
    options = build_run_options(spec, "gpu-01")
    assert options["user"] == f"{os.getuid()}:{os.getgid()}"
    assert options["cap_drop"] == ["ALL"] and options["security_opt"] == ["no-new-privileges"]
    assert options["privileged"] is False
    assert options["environment"] == {"HOME": "/tmp", "GANTRY_BUILD_ID": "4"}
