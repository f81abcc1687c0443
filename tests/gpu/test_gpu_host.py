"""A GPU host's code on a real GPU: the NVML inventory, a planned deployment
of an embedding model and a reranker on the GPU in real Triton (answers
compared with torch, per-process memory against the planned fractions under a
burst), GPU metrics, the over-headroom refusal, the GPU arguments of the
docker paths, and the SM gate for engines."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from django.utils import timezone
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from deployments import selectors
from deployments.errors import ValidationFailed
from deployments.models import BuildStatus, EngineBuild, GpuHost, MetricSample
from deployments.services import deployments, hosts
from deployments.services.placements import PlacementSpec
from tests.factories import LLAMA, registered_model, write_checkpoint
from workers import nvml
from workers.deploy import lifecycle, plan
from workers.deploy import telemetry as deploy_telemetry
from workers.runtimes import docker as docker_engine
from workers.runtimes import process
from workers.runtimes.base import LaunchSpec
from workers.triton.client import TritonClient

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


@pytest.fixture
def checkpoints(tmp_path: Path) -> dict[str, Path]:
    """Small real checkpoints made with transformers: a BERT encoder for
    embeddings and a BERT cross-encoder (one logit) for reranking."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

    words = sorted({w.strip(".,").lower() for text in TEXTS for w in text.split()} | {"query", "passage"})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, *[f"tok{i}" for i in range(200)]]
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "vocab.txt").write_text("\n".join(vocab))
    config = BertConfig(vocab_size=len(vocab), hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    made = {}
    for name, model in (("embedder", BertModel(config)), ("reranker", BertForSequenceClassification(config))):
        if name == "reranker":
            model.config.num_labels = 1
            model.classifier = torch.nn.Linear(config.hidden_size, 1)
        folder = root / name
        model.save_pretrained(folder, safe_serialization=True)
        BertTokenizerFast(vocab_file=str(root / "vocab.txt")).save_pretrained(folder)
        made[name] = folder
    return made


def _torch_embeddings(folder: Path, texts: list[str]) -> np.ndarray:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).cuda().eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt").to("cuda")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=1).cpu().numpy()


def _torch_scores(folder: Path, query: str, passages: list[str]) -> np.ndarray:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).cuda().eval()
    batch = tokenizer([query] * len(passages), passages, padding=True, truncation=True, max_length=256,
                      return_tensors="pt").to("cuda")  # fmt: skip
    with torch.no_grad():
        return model(**batch).logits.reshape(-1).float().cpu().numpy()


def _create(operator, fractions: tuple[float, float]):  # noqa: ANN001, ANN202
    return deployments.deployment_create(
        name="gpu-stack",
        host_name=GpuHost.objects.get().name,
        placements=[
            PlacementSpec(
                model="embedder",
                instance_kind="KIND_GPU",
                gpu_ids=(0,),
                gpu_memory_fraction=fractions[0],
                max_batch_size=32,
            ),
            PlacementSpec(
                model="reranker",
                instance_kind="KIND_GPU",
                gpu_ids=(0,),
                gpu_memory_fraction=fractions[1],
                max_batch_size=32,
            ),
        ],  # fmt: skip
        user=operator,
    )


def test_planned_deployment_runs_on_the_gpu_within_its_fractions(gpu_host, checkpoints, operator, report, settings):
    registered_model(name="embedder", kind="embedding", path=checkpoints["embedder"], host=gpu_host)
    registered_model(name="reranker", kind="reranker", path=checkpoints["reranker"], host=gpu_host)
    deployment = _create(operator, (EMBED_FRACTION, RERANK_FRACTION))
    plan = selectors.deployment_plan(selectors.deployment_list().get(pk=deployment.pk))
    assert plan[0]["fraction"] == pytest.approx(EMBED_FRACTION + RERANK_FRACTION) and plan[0]["within_headroom"]

    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    started = time.monotonic()
    lifecycle.launch(deployment.pk)  # what the host's launch task runs
    try:
        _exercise(deployment, checkpoints, operator, report, time.monotonic() - started)
    finally:
        # Whatever failed, leave no server behind (by process id, as the product does).
        for handle, repository in process.servers_under(plan.paths_for(deployment).root):
            process.stop(handle, repository)


def _exercise(deployment, checkpoints, operator, report, load_s: float) -> None:  # noqa: ANN001, C901
    deployment.refresh_from_db()
    assert deployment.status == "ready", deployment.status_message
    configs = {p.name: (p / "config.pbtxt").read_text() for p in plan.paths_for(deployment).repository.iterdir()}
    assert all("KIND_GPU" in text and "gpus: 0" in text for text in configs.values())

    client = TritonClient(f"127.0.0.1:{deployment.http_port}")
    served = client.embed("embedder", TEXTS)
    expected = _torch_embeddings(checkpoints["embedder"], TEXTS)
    embed_error = float(np.abs(served - expected).max())
    assert embed_error < 1e-3
    scores = client.rerank("reranker", "query", TEXTS)
    expected_scores = _torch_scores(checkpoints["reranker"], "query", TEXTS)
    rerank_error = float(np.abs(scores - expected_scores).max())
    assert rerank_error < 1e-3

    # A burst from 8 threads for 10 s, sampling NVML's per-process memory and utilization.
    total = nvml.read_inventory().gpus[0].memory_total_bytes
    peaks: dict[int, int] = {}
    utilization: list[int] = []
    counts = {"embed": 0, "rerank": 0}
    stop = threading.Event()

    def fire(kind: str) -> None:
        own = TritonClient(f"127.0.0.1:{deployment.http_port}")
        while not stop.is_set():
            if kind == "embed":
                own.embed("embedder", TEXTS * 8)
            else:
                own.rerank("reranker", "query", TEXTS * 4)
            counts[kind] += 1
        own.close()

    threads = [threading.Thread(target=fire, args=(k,)) for k in ["embed"] * 4 + ["rerank"] * 4]
    for thread in threads:
        thread.start()
    burst_started = time.monotonic()
    while time.monotonic() - burst_started < 10:
        for pid, used in nvml.compute_processes([0]).items():
            peaks[pid] = max(peaks.get(pid, 0), used)
        utilization.append(nvml.read_inventory().gpus[0].utilization_percent)
        deploy_telemetry.collect_metrics(deployment, nvml.read_inventory())
        time.sleep(0.5)
    stop.set()
    for thread in threads:
        thread.join()
    burst_s = time.monotonic() - burst_started

    runtime = plan.runtime_for(deployment)
    server_pids = set(runtime.pids(deployment.runtime_handle, plan.launch_spec(deployment)))
    stubs = {pid: used for pid, used in peaks.items() if pid in server_pids}
    assert stubs, f"no server process on the GPU: {peaks}"
    budget = max(EMBED_FRACTION, RERANK_FRACTION) * total
    assert all(used <= budget for used in stubs.values()), (stubs, budget)
    gpu_samples = MetricSample.objects.filter(deployment=deployment, kind="gpu")
    assert gpu_samples.exists()
    assert max(s.values.get("memory_used_bytes", 0) for s in gpu_samples) > 0
    assert max(s.values.get("utilization", 0) for s in gpu_samples) > 0

    deployments.deployment_stop(deployment_id=deployment.pk, user=operator)
    lifecycle.stop(deployment.pk)
    deployment.refresh_from_db()
    assert deployment.status == "stopped", deployment.status_message
    assert not set(nvml.compute_processes([0])) & server_pids

    report["deployment"] = {
        "load_to_ready_s": round(load_s, 2),
        "embed_max_abs_error_vs_torch": embed_error,
        "rerank_max_abs_error_vs_torch": rerank_error,
        "burst_s": round(burst_s, 1),
        "embed_requests_per_s": round(counts["embed"] / burst_s, 1),
        "rerank_requests_per_s": round(counts["rerank"] / burst_s, 1),
        "texts_per_embed_request": len(TEXTS) * 8,
        "peak_gpu_memory_per_server_process_bytes": stubs,
        "fraction_budget_bytes": {"embedder": EMBED_FRACTION * total, "reranker": RERANK_FRACTION * total},
        "utilization_percent_p50_p95_max": [
            float(np.percentile(utilization, 50)),
            float(np.percentile(utilization, 95)),
            max(utilization),
        ],  # fmt: skip
        "gpu_metric_samples": [s.values for s in gpu_samples.order_by("-at")[:3]],
    }


def test_over_headroom_plan_is_refused_before_launch(gpu_host, checkpoints, operator):
    registered_model(name="embedder", kind="embedding", path=checkpoints["embedder"], host=gpu_host)
    registered_model(name="reranker", kind="reranker", path=checkpoints["reranker"], host=gpu_host)
    with pytest.raises(ValidationFailed) as refused:
        _create(operator, (0.6, 0.5))
    assert refused.value.errors["models"] == ["GPU 0: memory fractions add up to 1.10, above the headroom limit 0.95"]


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
    for options in (build, serve):
        (request,) = options["device_requests"]
        assert request["DeviceIDs"] == ["0"] and request["Capabilities"] == [["gpu"]]
        assert options["shm_size"] == "2g" and options["privileged"] is False
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
            name="llm", host_name=gpu_host.name, runtime="docker", image=image,
            placements=[PlacementSpec(model="llama", engine_build=build.pk, gpu_memory_fraction=0.5)],
            user=operator,
        )  # fmt: skip
    assert refused.value.errors["models[0].gpu_ids"] == [
        f"build {build.pk} was built for SM 8.0 (NVIDIA A100-SXM4-80GB); "
        f"GPU 0 is {gpu.name} with SM {gpu.compute_capability}"
    ]
