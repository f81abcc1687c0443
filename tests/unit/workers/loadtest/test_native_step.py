"""A native-ceiling step end to end on the worker's side, with a stand-in
trtllm-bench (tests/fixtures/trtllm_standin.py: CI has no TensorRT-LLM and no
GPU; NVML's answer is given, as a GPU host's would be): the dataset and
command line it gets, its environment, the report read into a step beside the
served ones, and the refusals when the GPUs are full or it fails."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from django.utils import timezone

from deployments.models import BuildStatus, EngineBuild
from deployments.services import deployments
from deployments.services.placements import PlacementSpec
from gateway.models import Alias
from hosts.services.hosts import GpuReport
from loadtests import selectors, services
from loadtests.models import LoadPoint, LoadTest
from tests import factories
from workers import nvml
from workers.jobs import JobFailed
from workers.loadtest import aiperf, runs

pytestmark = pytest.mark.django_db

STANDIN = Path(__file__).resolve().parents[3] / "fixtures" / "trtllm_standin.py"
ENGINE_BYTES = 2 << 30


@pytest.fixture
def trt_python(tmp_path: Path, settings) -> Path:  # noqa: ANN001
    """A host python with 'tensorrt_llm' beside it: the stand-in as its trtllm-bench."""
    bin_dir = tmp_path / "trt" / "bin"
    bin_dir.mkdir(parents=True)
    bench = bin_dir / "trtllm-bench"
    bench.write_text(f"#!{sys.executable}\n" + STANDIN.read_text())
    bench.chmod(0o755)
    settings.GANTRY_TRTLLM_PYTHON = str(bin_dir / "python3")
    settings.GANTRY_DATA_DIR = str(tmp_path / "data")
    os.environ["TRTLLM_STANDIN_VERSION"] = "0.20.0"
    yield bin_dir
    os.environ.pop("TRTLLM_STANDIN_VERSION", None)


def _gpus(free_gib: float) -> nvml.Inventory:
    used = (80 << 30) - int(free_gib * 2**30)
    return nvml.Inventory(gpus=[GpuReport(index=0, uuid="GPU-0", name=factories.H100, compute_capability="9.0",
                                          memory_total_bytes=80 << 30, memory_used_bytes=used)])  # fmt: skip


@pytest.fixture
def stack(tmp_path: Path, builder_images, operator, trt_python):  # noqa: ANN001, ANN201
    host = factories.gpu_host("trt-host", builders={"images": {factories.IMAGE: factories.IMAGE_DIGEST},
                                                    "native": "0.20.0"})  # fmt: skip
    checkpoint = factories.write_checkpoint(tmp_path / "llama", factories.LLAMA)
    model = factories.registered_model(name="llama", kind="llm", path=checkpoint, host=host)
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({"pretrained_config": {"dtype": "float16"}, "build_config": {}}))
    build = EngineBuild.objects.create(
        model=model, host=host, spec={"max_batch_size": 32, "max_seq_len": 2048, "max_beam_width": 1,
                                      "quantization": "none"},
        builder_image=factories.IMAGE, image_digest=factories.IMAGE_DIGEST, trtllm_version="0.20.0",
        gpu_name=factories.H100, compute_capability="9.0", status=BuildStatus.SUCCEEDED, output_dir=str(engine),
        artifacts=[{"name": "rank0.engine", "size": ENGINE_BYTES, "sha256": "0"}], cache_key="k",
        finished_at=timezone.now(),
    )  # fmt: skip
    factories.surveyed()
    deployment = deployments.deployment_create(
        name="stack", hosts=[host.name], runtime="docker", image=factories.IMAGE, user=operator,
        placements=[PlacementSpec(model="llama", engine_build=build.pk, gpu_memory_fraction=0.5)],
    )  # fmt: skip
    deployment = factories.deployment_in(deployment, "launching", "loading", "ready")
    Alias.objects.create(name="chat", deployment=deployment, triton_name="llama")
    spec = {"levels": [2], "request_count": 6, "warmup_requests": 1, "native": True}
    run = services.run_create(deployment_id=deployment.pk, alias="chat", user=operator, spec=spec)
    run = services.run_claim(run_id=run.pk, source="test")
    placement = deployment.placements.select_related("registered_model", "engine_build").get()
    return run, deployment, placement


def _native(run: LoadTest, deployment, placement, tmp_path: Path) -> None:  # noqa: ANN001
    step = aiperf.Step(target="native", level=2, index=1, total=2)
    runs._native_step(run, step, deployment=deployment, placement=placement, workdir=tmp_path / "native")


def test_a_native_step_runs_trtllm_bench_on_the_engine_and_keeps_its_figures(stack, tmp_path, monkeypatch):  # noqa: ANN001
    run, deployment, placement = stack
    monkeypatch.setattr(nvml, "read_inventory", lambda: _gpus(free_gib=40))
    monkeypatch.setenv("DATABASE_PASSWORD_FOR_TEST", "secret")
    _native(run, deployment, placement, tmp_path)
    point = LoadPoint.objects.get(run=run, target="native")
    assert point.level == 2 and point.complete and point.records == []
    assert point.summary["request_count"] == 6 and point.summary["counted"] == {"requests": 6, "errors": 0,
                                                                                "by_code": {}}  # fmt: skip
    assert point.summary["request_throughput"] == 12.0 and point.summary["time_to_first_token"]["p50"] == 10.0
    report = json.loads((tmp_path / "native" / "report.json").read_text())
    argv = report["standin"]["argv"]
    assert argv[argv.index("--engine_dir") + 1] == placement.engine_build.output_dir
    assert argv[argv.index("--concurrency") + 1] == "2" and argv[argv.index("--num_requests") + 1] == "6"
    assert "--streaming" in argv and argv[argv.index("--warmup") + 1] == "1"
    # Gantry's own settings stay with Gantry; the GPUs are the placement's.
    assert "DATABASE_PASSWORD_FOR_TEST" not in report["standin"]["environ"]
    assert "CUDA_VISIBLE_DEVICES" in report["standin"]["environ"]
    dataset = (tmp_path / "native" / "dataset.jsonl").read_text().splitlines()
    assert len(dataset) == 7 and len(json.loads(dataset[0])["input_ids"]) == run.workload["input_tokens"]
    # Beside a served step at the same level, the run shows served/native.
    now = timezone.now()
    services.point_save(run_id=run.pk, target="gateway", level=2, complete=True, records=[], server={},
                        summary={"request_throughput": 6.0, "output_token_throughput": 300.0},
                        started_at=now, finished_at=now)  # fmt: skip
    (row,) = selectors.ceiling(selectors.points_of([run.pk])[run.pk])
    assert row["target"] == "gateway" and row["request_throughput"] == {"served": 6.0, "native": 12.0, "ratio": 0.5}
    assert row["output_token_throughput"]["native"] == point.summary["output_token_throughput"]


def test_a_gpu_without_room_for_a_second_engine_copy_is_refused_before_starting(stack, tmp_path, monkeypatch):  # noqa: ANN001
    run, deployment, placement = stack
    monkeypatch.setattr(nvml, "read_inventory", lambda: _gpus(free_gib=1))
    with pytest.raises(JobFailed, match="GPU 0 has 1.0 GiB free: trtllm-bench loads a second copy"):
        _native(run, deployment, placement, tmp_path)
    assert not (tmp_path / "native").exists() and not LoadPoint.objects.filter(run=run).exists()


def test_a_failing_trtllm_bench_fails_the_step_with_its_last_line(stack, tmp_path, monkeypatch):  # noqa: ANN001
    run, deployment, placement = stack
    monkeypatch.setattr(nvml, "read_inventory", lambda: _gpus(free_gib=40))
    config = Path(placement.registered_model.path) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "gantry_standin": {"bench_fail": True}}))
    with pytest.raises(JobFailed, match="exit code 1 before writing its report.*Engine supports a max sequence"):
        _native(run, deployment, placement, tmp_path)


def test_synthetic_token_ids_need_the_vocabulary_the_inspection_recorded(stack, tmp_path, monkeypatch):  # noqa: ANN001
    run, deployment, placement = stack
    monkeypatch.setattr(nvml, "read_inventory", lambda: _gpus(free_gib=40))
    placement.registered_model.vocab_size = None
    with pytest.raises(JobFailed, match="llama's inspection found no vocab_size"):
        _native(run, deployment, placement, tmp_path)
    assert not (tmp_path / "native").exists()
