"""A GPU host's code on a real GPU: the NVML inventory, the GPU arguments of
the docker paths, and the SM gate for engines. The seeds' stack through the
control plane is test_seed_stack.py; the memory caps are test_caps.py."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from django.utils import timezone

from common.errors import ValidationFailed
from deployments.models import BuildStatus, EngineBuild
from deployments.services import deployments
from deployments.services.placements import PlacementSpec
from hosts.models import GpuHost
from hosts.services import hosts
from tests.factories import LLAMA, registered_model, write_checkpoint
from triton_server.server import LaunchSpec
from workers import nvml
from workers.runtimes import docker as docker_engine

# Not transactional: nothing is queued (there is no broker on the GPU machine), the test runs the host side itself.
pytestmark = [pytest.mark.gpu, pytest.mark.django_db]

EMBED_FRACTION = 0.05
RERANK_FRACTION = 0.04
TEXTS = ["Triton serves models on GPUs.", "Gantry plans the GPU memory.", "The cat sat on the mat."]


def _smi(query: str) -> list[str]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [field.strip() for field in out.splitlines()[0].split(",")]


def test_inventory_matches_nvidia_smi(report):
    inventory = nvml.read_inventory()
    assert not inventory.error
    gpu = inventory.gpus[0]
    uuid, name, cc, memory_mib, driver = _smi("uuid,name,compute_cap,memory.total,driver_version")
    assert gpu.uuid == uuid and gpu.name == name and gpu.compute_capability == cc
    assert gpu.memory_total_bytes // 2**20 == int(memory_mib)
    assert inventory.driver_version == driver
    header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, check=True).stdout
    assert inventory.cuda_version == re.search(r"CUDA Version:\s*([\d.]+)", header).group(1)
    report["inventory"] = {
        "name": gpu.name, "uuid": gpu.uuid, "compute_capability": gpu.compute_capability,
        "memory_total_bytes": gpu.memory_total_bytes, "driver": inventory.driver_version,
        "cuda": inventory.cuda_version, "gpus": len(inventory.gpus),
    }  # fmt: skip


@pytest.fixture
def gpu_host(db):  # noqa: ANN001, ANN201
    inventory = nvml.read_inventory()
    from django.conf import settings

    return hosts.host_heartbeat(
        name=settings.GANTRY_HOST_NAME,
        driver_version=inventory.driver_version,
        cuda_version=inventory.cuda_version,
        gpus=inventory.gpus,
    )


def test_docker_paths_compose_the_gpu_arguments(gpu_host):
    ulimits = (("memlock", -1, -1), ("stack", 67108864, 67108864))
    build = docker_engine.build_run_options(
        docker_engine.BuildContainerSpec(
            build_id=1,
            step=0,
            image="builder",
            argv=["trtllm-build"],
            gpu_ids=(0,),
            read_only=("/models/x",),
            read_write=("/data/builds/1",),
            ulimits=ulimits,
            env={},
        ),  # fmt: skip
        gpu_host.name,
    )
    serve = docker_engine.run_options(
        LaunchSpec(
            deployment_id=1,
            generation=1,
            repository=Path("/repo"),
            models=["m"],
            http_port=18000,
            grpc_port=18001,
            metrics_port=18002,
            log_path=Path("/log"),
            image="triton",
            gpu_ids=(0,),
            ulimits=ulimits,
        ),  # fmt: skip
        gpu_host.name,
    )
    assert (build["shm_size"], serve["shm_size"]) == ("2g", "2048m")  # the seeds' 16 GB is a deployment setting
    for options in (build, serve):
        (request,) = options["device_requests"]
        assert request["DeviceIDs"] == ["0"] and request["Capabilities"] == [["gpu"]]
        assert options["privileged"] is False
        assert options["cap_drop"] == ["ALL"] and options["user"] == f"{os.getuid()}:{os.getgid()}"
        assert {u["Name"]: (u["Soft"], u["Hard"]) for u in options["ulimits"]} == {
            "memlock": (-1, -1), "stack": (67108864, 67108864),
        }  # fmt: skip
    assert nvml.read_inventory().gpus[0].compute_capability == "9.0"


def test_engine_built_for_sm80_is_refused_on_this_gpu(gpu_host, operator, tmp_path, settings):

    image = "tritonserver:24.12-trtllm-python-py3"
    settings.GANTRY_BUILDER_IMAGES = {image: "0.16.0"}
    settings.GANTRY_ALLOWED_IMAGES = [image]
    GpuHost.objects.filter(pk=gpu_host.pk).update(builders={"images": {image: "sha256:" + "ab" * 32}})
    llama = registered_model(name="llama", kind="llm", path=write_checkpoint(tmp_path / "llama", LLAMA),
                               host=gpu_host)  # fmt: skip
    gpu = nvml.read_inventory().gpus[0]
    build = EngineBuild.objects.create(
        model=llama, host=gpu_host, spec={"max_batch_size": 32, "max_seq_len": 2048}, builder_image=image,
        image_digest="sha256:" + "ab" * 32, trtllm_version="0.16.0", gpu_name="NVIDIA A100-SXM4-80GB",
        compute_capability="8.0", status=BuildStatus.SUCCEEDED, output_dir="/data/builds/1/engine",
        artifacts=[{"name": "rank0.engine", "size": 2_500_000_000, "sha256": "0"}], cache_key="sm80",
        finished_at=timezone.now(),
    )  # fmt: skip
    with pytest.raises(ValidationFailed) as refused:
        deployments.deployment_create(
            name="llm", hosts=[gpu_host.name], runtime="docker", image=image,
            placements=[PlacementSpec(model="llama", engine_build=build.pk, gpu_memory_fraction=0.5)],
            user=operator,
        )  # fmt: skip
    assert refused.value.errors["models[0].gpu_ids"] == [
        f"build {build.pk} was built for SM 8.0 (NVIDIA A100-SXM4-80GB); "
        f"GPU 0 is {gpu.name} with SM {gpu.compute_capability}"
    ]
