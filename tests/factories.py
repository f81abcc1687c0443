"""Factories for tests: GPU hosts, registered checkpoints, deployments, engine
builds and launch specs, made through the services (as a user or worker would)
so every row is one the product itself could have written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deployments import states
from deployments.models import BuildStatus, Deployment, EngineBuild, RegisteredModel, Replica
from deployments.services import builds, deployments, registered_models, replicas
from deployments.services.placements import PlacementSpec
from hosts.models import GpuHost
from hosts.services import hosts
from hosts.services.hosts import GpuReport
from triton_server.server import LaunchSpec

# The builder image the unit tests allow-list, with the digest its host reports.
IMAGE = "tritonserver:24.12-trtllm-python-py3"
IMAGE_DIGEST = "sha256:" + "ab" * 32
H100 = "NVIDIA H100 80GB HBM3"

# A Llama-3.2-1B-shaped config.json: the shape engine planning reads.
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def cpu_host(name: str = "cpu-host") -> GpuHost:
    """A host with no GPUs that has just beaten."""
    return hosts.host_heartbeat(name=name, address="127.0.0.1", gpus=[])


def gpu_host(
    name: str = "gpu-host",
    *,
    cc: str = "9.0",
    count: int = 1,
    gpu_name: str = H100,
    memory_total_bytes: int = 80 << 30,
    builders: dict[str, Any] | None = None,
    **beat: Any,
) -> GpuHost:
    """A host with ``count`` identical GPUs of compute capability ``cc``."""
    return hosts.host_heartbeat(
        name=name,
        address="127.0.0.1",
        gpus=[
            GpuReport(
                index=i,
                uuid=f"GPU-{name}-{i}",
                name=gpu_name,
                compute_capability=cc,
                memory_total_bytes=memory_total_bytes,
            )
            for i in range(count)
        ],
        builders=builders,
        **beat,
    )


def trtllm_host(name: str, cc: str, count: int = 1, gpu_name: str = H100) -> GpuHost:
    """A GPU host that reports the allow-listed builder image present."""
    return gpu_host(
        name, cc=cc, count=count, gpu_name=gpu_name, builders={"images": {IMAGE: IMAGE_DIGEST}, "native": ""}
    )


def write_checkpoint(folder: Path, config: dict) -> Path:
    """A minimal checkpoint folder: config.json, one safetensors tensor, a tokenizer file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    header = json.dumps({"w": {"dtype": "F16", "shape": [4, 4], "data_offsets": [0, 32]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 32)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def registered_model(*, name: str, kind: str, path: Path, host: GpuHost) -> RegisteredModel:
    """Register a checkpoint and run the host's inspection in this process (what its worker would do)."""
    model = registered_models.model_register(name=name, kind=kind, path=str(path), host=host.name)
    registered_models.model_inspect(model_id=model.pk, source="test")
    model.refresh_from_db()
    return model


def surveyed() -> None:
    """Every host's agent looks for the registered checkpoints on its disk
    (workers.deploy.copies.survey), here where every host shares this machine's
    files: each host holds every checkpoint it can read."""
    from django.test import override_settings

    from workers.deploy import copies

    for name in GpuHost.objects.values_list("name", flat=True):
        with override_settings(GANTRY_HOST_NAME=name):
            copies.survey()


def deployment(
    *, host: GpuHost, models: list[str] | None = None, name: str = "d", user: Any = None, **placement: Any
) -> Deployment:
    """A stopped deployment of ``models`` (each with ``placement`` settings)
    pinned to ``host``; every host has surveyed its disk first."""
    surveyed()
    return deployments.deployment_create(
        name=name,
        hosts=[host.name],
        placements=[PlacementSpec(model=m, **placement) for m in models or ["minilm"]],
        user=user,
    )


def deployment_in(deployment_row: Deployment, *path: str, handle: str = "1") -> Deployment:
    """Walk a deployment's one replica along ``path`` (e.g. launching, loading,
    ready) as its worker would; "launching" first starts the deployment (which
    places the replica)."""
    for to in path:
        replica = Replica.objects.filter(deployment_id=deployment_row.pk).order_by("serial").first()
        if to == "launching" and (replica is None or replica.status in ("pending", "stopped")):
            surveyed()
            replicas.deployment_start(deployment_id=deployment_row.pk, source="test")
            continue
        states.replica_transition(
            replica_id=replica.pk,
            to=to,
            source="test",
            runtime_handle=handle if to == "loading" else None,
        )
    return Deployment.objects.get(pk=deployment_row.pk)


def replica_of(deployment_row: Deployment) -> Replica:
    """The deployment's first replica, with its host and deployment."""
    return (
        Replica.objects.select_related("host", "deployment").filter(deployment_id=deployment_row.pk).earliest("serial")
    )


def succeeded_build(build: EngineBuild) -> EngineBuild:
    """Finish a pending build as its worker would: claim it, then record it succeeded."""
    builds.build_claim(build_id=build.pk, source=f"worker:{build.host.name}", output_dir="/x")
    return builds.build_finish(
        build_id=build.pk, to=BuildStatus.SUCCEEDED, source=f"worker:{build.host.name}", message="ok"
    )


def launch_spec(tmp: Path = Path("/data/deployments/7-d"), **overrides: Any) -> LaunchSpec:
    """A LaunchSpec of one model on the usual ports."""
    fields: dict[str, Any] = {
        "deployment_id": 7,
        "generation": 1,
        "repository": tmp / "repository",
        "models": ["minilm"],
        "http_port": 8000,
        "grpc_port": 8001,
        "metrics_port": 8002,
        "log_path": tmp / "tritonserver.log",
    }
    return LaunchSpec(**{**fields, **overrides})


def replica_for(deployment_row: Deployment, *, gpu_map: dict[int, int] | None = None) -> Replica:
    """An unsaved replica of the deployment on its first pinned host (its GPU
    numbers the host's own unless ``gpu_map`` says otherwise), for what a
    host's worker would plan from it."""
    deployment_row = Deployment.objects.prefetch_related(
        "placements__registered_model__host", "placements__engine_build"
    ).get(pk=deployment_row.pk)
    host = GpuHost.objects.prefetch_related("gpus").get(pk=deployment_row.pinned_hosts.order_by("name").first().pk)
    return Replica(
        deployment=deployment_row, serial=1, host=host, gpu_map={str(k): v for k, v in (gpu_map or {}).items()},
        http_port=8000, grpc_port=8001, metrics_port=8002, generation=deployment_row.generation,
    )  # fmt: skip


def replica_row(deployment_id: int) -> Replica:
    """A deployment's first replica as the database holds it now."""
    return Replica.objects.select_related("host", "deployment").filter(deployment_id=deployment_id).earliest("serial")
