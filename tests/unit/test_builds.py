"""Engine builds: the command lines against the version table, the spec rules,
the build cache, cancellation, the reaper and the audit trail."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from deployments import builds, services, trtllm
from deployments.errors import ValidationFailed
from deployments.models import BuildStatus, EngineBuild, Event, GpuHost, RegisteredModel
from tests.conftest import register_inspected
from workers import builder, nvml

IMAGE = "tritonserver:24.12-trtllm-python-py3"
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


def write_checkpoint(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    header = json.dumps({"w": {"dtype": "F16", "shape": [4, 4], "data_offsets": [0, 32]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 32)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def gpu_host_with(name: str, cc: str, count: int = 1, gpu_name: str = "NVIDIA H100 80GB HBM3") -> GpuHost:
    return services.host_heartbeat(
        name=name,
        gpus=[
            services.GpuReport(
                index=i, uuid=f"GPU-{name}-{i}", name=gpu_name, compute_capability=cc, memory_total_bytes=80 << 30
            )
            for i in range(count)
        ],
        builders={"images": {IMAGE: "sha256:" + "ab" * 32}, "native": ""},
    )


@pytest.fixture
def builder_images(settings):  # noqa: ANN001, ANN201
    settings.GANTRY_BUILDER_IMAGES = {IMAGE: "0.16.0", "tritonserver:24.08-trtllm-python-py3": "0.12.0"}


@pytest.fixture
def h100(db, builder_images) -> GpuHost:  # noqa: ANN001
    return gpu_host_with("h100-host", "9.0", count=2)


@pytest.fixture
def llama(db, tmp_path: Path, h100: GpuHost) -> RegisteredModel:  # noqa: ANN001
    return register_inspected(name="llama", kind="llm", path=write_checkpoint(tmp_path / "llama", LLAMA), host=h100)


def request(operator, **spec):  # noqa: ANN001, ANN003, ANN201
    return builds.build_request(model="llama", host="h100-host", image=IMAGE, spec=spec, user=operator)


def paths() -> trtllm.BuildPaths:
    return trtllm.BuildPaths(
        checkpoint=Path("/models/llama"),
        converted=Path("/data/builds/7/converted"),
        engine=Path("/data/builds/7/engine"),
        timing_cache=Path("/data/timing-cache/h100.cache"),
    )


def normalized(**overrides) -> dict:  # noqa: ANN003
    return {**builds.DEFAULTS, **overrides}


DOCKER_TOOLS = trtllm.Toolchain(
    python=["python3"], trtllm_build=["trtllm-build"], examples_dir="/app/tensorrt_llm/examples"
)


# --- the command lines --------------------------------------------------------------


def test_command_lines_for_the_seeds_image_are_pinned():
    steps = trtllm.compose(normalized(), trtllm.RELEASES["0.16.0"], paths(), DOCKER_TOOLS, "LlamaForCausalLM")
    assert [s.phase for s in steps] == ["converting", "building"]
    assert steps[0].argv == [
        "python3", "/app/tensorrt_llm/examples/llama/convert_checkpoint.py",
        "--model_dir", "/models/llama", "--output_dir", "/data/builds/7/converted", "--dtype", "float16",
        "--tp_size", "1", "--pp_size", "1", "--workers", "1",
    ]  # fmt: skip
    assert steps[1].argv == [
        "trtllm-build",
        "--checkpoint_dir", "/data/builds/7/converted", "--output_dir", "/data/builds/7/engine",
        "--max_batch_size", "8", "--max_input_len", "1024", "--max_seq_len", "2048", "--max_num_tokens", "8192",
        "--max_beam_width", "1", "--gemm_plugin", "float16", "--gpt_attention_plugin", "float16",
        "--context_fmha", "enable", "--use_paged_context_fmha", "enable", "--remove_input_padding", "enable",
        "--kv_cache_type", "paged",
        "--input_timing_cache", "/data/timing-cache/h100.cache",
        "--output_timing_cache", "/data/timing-cache/h100.cache",
        "--workers", "1", "--log_level", "info",
    ]  # fmt: skip


def test_older_release_selects_the_paged_kv_cache_with_its_own_flag():
    steps = trtllm.compose(normalized(), trtllm.RELEASES["0.12.0"], paths(), DOCKER_TOOLS, "LlamaForCausalLM")
    build = steps[-1].argv
    assert "--kv_cache_type" not in build
    assert build[build.index("--paged_kv_cache") + 1] == "enable"


def test_newer_release_finds_converters_under_models_core():
    steps = trtllm.compose(normalized(), trtllm.RELEASES["0.20.0"], paths(), DOCKER_TOOLS, "Qwen2ForCausalLM")
    assert steps[0].argv[1] == "/app/tensorrt_llm/examples/models/core/qwen/convert_checkpoint.py"
    assert "--paged_kv_cache" not in steps[-1].argv


@pytest.mark.parametrize("version", sorted(trtllm.RELEASES))
@pytest.mark.parametrize("quantization", trtllm.QUANTIZATIONS)
def test_every_composed_flag_exists_in_its_release(version, quantization):
    release = trtllm.RELEASES[version]
    steps = trtllm.compose(
        normalized(quantization=quantization, tp_size=2, workers=2), release, paths(), DOCKER_TOOLS, "LlamaForCausalLM"
    )
    allowed = {
        "quantizing": release.quantize_flags,
        "converting": release.convert_flags,
        "building": release.build_flags,
    }
    for step in steps:
        flags = {arg for arg in step.argv if arg.startswith("--")}
        assert flags <= allowed[step.phase], (version, step.phase, flags - allowed[step.phase])


def test_fp8_quantizes_instead_of_converting_and_weight_only_converts_with_its_precision():
    fp8 = trtllm.compose(
        normalized(quantization="fp8"), trtllm.RELEASES["0.16.0"], paths(), DOCKER_TOOLS, "LlamaForCausalLM"
    )
    assert fp8[0].phase == "quantizing" and fp8[0].argv[1].endswith("quantization/quantize.py")
    assert ["--qformat", "fp8"] == fp8[0].argv[fp8[0].argv.index("--qformat") : fp8[0].argv.index("--qformat") + 2]
    int4 = trtllm.compose(
        normalized(quantization="int4_wo"), trtllm.RELEASES["0.16.0"], paths(), DOCKER_TOOLS, "LlamaForCausalLM"
    )
    assert "--use_weight_only" in int4[0].argv and int4[0].argv[-1] == "int4"


def test_flag_missing_from_a_release_is_refused_at_composition():
    release = trtllm.RELEASES["0.16.0"]
    stripped = trtllm.Release(**{**release.__dict__, "build_flags": release.build_flags - {"--max_num_tokens"}})
    with pytest.raises(ValueError, match="has no --max_num_tokens"):
        trtllm.compose(normalized(), stripped, paths(), DOCKER_TOOLS, "LlamaForCausalLM")


# --- the spec rules -----------------------------------------------------------------


def errors_of(call) -> dict:  # noqa: ANN001
    with pytest.raises(ValidationFailed) as caught:
        call()
    return caught.value.errors


def test_fp8_needs_compute_capability_8_9(db, operator, builder_images, tmp_path):
    a100 = gpu_host_with("a100-host", "8.0", gpu_name="NVIDIA A100-SXM4-80GB")
    register_inspected(name="llama", kind="llm", path=write_checkpoint(tmp_path / "l", LLAMA), host=a100)
    errors = errors_of(
        lambda: builds.build_request(
            model="llama", host="a100-host", image=IMAGE, spec={"quantization": "fp8"}, user=operator
        )
    )
    assert errors == {"quantization": ["fp8 needs compute capability 8.9 or higher; NVIDIA A100-SXM4-80GB has 8.0"]}
    assert EngineBuild.objects.count() == 0


def test_bfloat16_needs_ampere(db, operator, builder_images, tmp_path):
    t4 = gpu_host_with("t4-host", "7.5", gpu_name="Tesla T4")
    register_inspected(name="llama", kind="llm", path=write_checkpoint(tmp_path / "l", LLAMA), host=t4)
    errors = errors_of(
        lambda: builds.build_request(
            model="llama", host="t4-host", image=IMAGE, spec={"dtype": "bfloat16"}, user=operator
        )
    )
    assert "bfloat16 needs compute capability 8.0" in errors["dtype"][0]


def test_length_rules_name_their_fields(llama, operator):
    errors = errors_of(lambda: request(operator, max_input_len=4096, max_seq_len=2048))
    assert errors["max_seq_len"] == ["must be at least max_input_len (4096)"]
    errors = errors_of(lambda: request(operator, max_seq_len=8192))
    assert "exceeds the checkpoint's max_position_embeddings (4096)" in errors["max_seq_len"][0]
    build, how = request(operator, max_seq_len=8192, allow_seq_len_over_max_positions=True)
    assert how == "queued" and build.spec["max_seq_len"] == 8192


def test_parallelism_must_fit_the_host_and_the_model(llama, operator):
    assert errors_of(lambda: request(operator, tp_size=4))["tp_size"] == [
        "tp_size * pp_size = 4 GPUs, but h100-host has 2"
    ]
    assert errors_of(lambda: request(operator, tp_size=2, gpu_ids=[0, 5]))["gpu_ids"] == ["h100-host has no GPU 5"]
    assert errors_of(lambda: request(operator, workers=2))["workers"] == ["must be at most tp_size * pp_size (1)"]
    build, _ = request(operator, tp_size=2, workers=2)
    assert build.gpu_ids == [0, 1] and build.world_size == 2


def test_unsupported_architecture_is_refused_with_the_supported_list(db, operator, h100, tmp_path):
    bert = {**LLAMA, "architectures": ["BertModel"]}
    register_inspected(name="llama", kind="llm", path=write_checkpoint(tmp_path / "b", bert), host=h100)
    message = errors_of(lambda: request(operator))["model"][0]
    assert message.startswith("architecture BertModel is not supported; supported: FalconForCausalLM, GPT2LMHeadModel")


def test_builder_image_must_be_allow_listed_and_on_the_host(llama, operator, settings):
    errors = errors_of(
        lambda: builds.build_request(model="llama", host="h100-host", image="evil:latest", spec={}, user=operator)
    )
    assert "'evil:latest' is not an allow-listed builder image" in errors["image"][0]
    settings.GANTRY_BUILDER_IMAGES = {
        **settings.GANTRY_BUILDER_IMAGES,
        "tritonserver:25.06-trtllm-python-py3": "0.20.0",
    }
    errors = errors_of(
        lambda: builds.build_request(
            model="llama", host="h100-host", image="tritonserver:25.06-trtllm-python-py3", spec={}, user=operator
        )
    )
    assert errors["image"][0].startswith("tritonserver:25.06-trtllm-python-py3 is not on h100-host: pull it there")


def test_unknown_build_setting_is_named(llama, operator):
    assert errors_of(lambda: request(operator, max_batch=4)) == {"max_batch": ["is not a build setting"]}


def test_build_api_refuses_bad_types_and_names_the_field(api, llama):
    response = api.post(
        "/api/builds/",
        {"model": "llama", "host": "h100-host", "image": IMAGE, "spec": {"dtype": "fp64"}},
        format="json",
    )
    assert response.status_code == 400
    assert "spec" in response.data["errors"] and "dtype" in response.data["errors"]["spec"]


# --- the cache, cancelling, the reaper ----------------------------------------------------


def _succeed(build: EngineBuild) -> None:
    builds.build_claim(build_id=build.pk, source="worker:h100-host", output_dir="/x")
    builds.build_finish(build_id=build.pk, to=BuildStatus.SUCCEEDED, source="worker:h100-host", message="ok")


def test_identical_request_returns_the_succeeded_build_and_force_rebuilds(api, llama):
    body = {"model": "llama", "host": "h100-host", "image": IMAGE, "spec": {"max_batch_size": 16}}
    first = api.post("/api/builds/", body, format="json")
    assert first.status_code == 201 and first.data["how"] == "queued"
    joined = api.post("/api/builds/", body, format="json")
    assert joined.status_code == 200 and joined.data["how"] == "joined" and joined.data["id"] == first.data["id"]
    _succeed(EngineBuild.objects.get(pk=first.data["id"]))
    again = api.post("/api/builds/", {**body, "spec": {"max_batch_size": 16, "gpu_ids": [1]}}, format="json")
    assert again.status_code == 200 and again.data["how"] == "cached" and again.data["id"] == first.data["id"]
    forced = api.post("/api/builds/", {**body, "force": True}, format="json")
    assert forced.status_code == 201 and forced.data["id"] != first.data["id"] and forced.data["forced"]
    other = api.post("/api/builds/", {**body, "spec": {"max_batch_size": 32}}, format="json")
    assert other.status_code == 201
    assert Event.objects.filter(kind="build.reused", build_id=first.data["id"]).count() == 1


def test_concurrent_identical_requests_start_one_build(transactional_db, operator, builder_images, tmp_path):
    host = gpu_host_with("h100-host", "9.0")
    register_inspected(name="llama", kind="llm", path=write_checkpoint(tmp_path / "l", LLAMA), host=host)
    barrier = threading.Barrier(4)
    results = []

    def ask() -> None:
        barrier.wait()
        try:
            results.append(request(operator)[1])
        finally:
            connection.close()

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert EngineBuild.objects.count() == 1
    assert sorted(results).count("queued") == 1 and len(results) == 4


def test_pending_build_cancels_at_once_and_running_one_is_asked_to_stop(llama, operator):
    pending, _ = request(operator)
    assert builds.build_cancel(build_id=pending.pk, user=operator).status == BuildStatus.CANCELLED
    running, _ = request(operator, max_batch_size=4)
    builds.build_claim(build_id=running.pk, source="worker:h100-host", output_dir="/x")
    assert builds.build_cancel(build_id=running.pk, user=operator).status == BuildStatus.CANCELLING
    ended = builds.build_finish(build_id=running.pk, to=BuildStatus.FAILED, source="worker:h100-host", message="killed")
    assert ended.status == BuildStatus.CANCELLED


def test_build_whose_worker_went_quiet_is_failed_by_the_reaper(llama, operator):
    build, _ = request(operator)
    builds.build_claim(build_id=build.pk, source="worker:h100-host", output_dir="/x")
    assert builds.builds_reap() == []
    EngineBuild.objects.filter(pk=build.pk).update(heartbeat_at=timezone.now() - timedelta(minutes=10))
    assert builds.builds_reap() == [build.pk]
    build.refresh_from_db()
    assert build.status == BuildStatus.FAILED and "stopped reporting" in build.status_message


def test_second_delivery_of_a_claimed_build_does_nothing(llama, operator):
    build, _ = request(operator)
    assert builds.build_claim(build_id=build.pk, source="worker:h100-host", output_dir="/x") is not None
    assert builds.build_claim(build_id=build.pk, source="worker:h100-host", output_dir="/x") is None
    builder.run_build(build.pk)  # a redelivered task: the row is running, so nothing starts
    assert list(Event.objects.filter(build=build, kind="build.status").values_list("to_status", flat=True)) == [
        "running"
    ]
    assert not builder.work_dir(build.pk).exists()


# --- hints and verification ------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("RuntimeError: CUDA runtime error in cudaMalloc: out of memory", "ran out of memory"),
        ("[TRT] The engine plan file is generated on an incompatible device", "does not support the GPU's SM"),
        (
            "FileNotFoundError: [Errno 2] No such file or directory: '/models/x/config.json'",
            "checkpoint files are missing",
        ),
        ("Traceback: KeyError 'foo'", ""),
    ],
)
def test_known_failure_causes_get_a_hint(line, expected):
    assert (expected in builder.hint_for(["building", line])) if expected else builder.hint_for([line]) == ""


def test_engine_that_does_not_match_the_request_fails_verification(llama, operator, tmp_path):
    build, _ = request(operator, max_batch_size=16)
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "rank0.engine").write_bytes(b"x" * 10)
    config = {
        "version": "0.16.0",
        "pretrained_config": {"mapping": {"tp_size": 1, "pp_size": 1}},
        "build_config": {
            **{k: build.spec[k] for k in ("max_input_len", "max_seq_len", "max_num_tokens")},
            "max_batch_size": 8,
        },
    }
    (engine / "config.json").write_text(json.dumps(config))
    with pytest.raises(builder.StepEnded, match="max_batch_size 8 instead of 16"):
        builder.verify_engine(build, engine)
    config["build_config"]["max_batch_size"] = 16
    (engine / "config.json").write_text(json.dumps(config))
    recorded = builder.verify_engine(build, engine)
    assert [a["name"] for a in recorded["artifacts"]] == ["config.json", "rank0.engine"]
    assert recorded["artifacts"][1]["size"] == 10 and len(recorded["artifacts"][1]["sha256"]) == 64


# --- audit -----------------------------------------------------------------------------


def test_admin_shows_a_build_read_only_with_its_history(client, django_user_model, llama, operator):
    build, _ = request(operator)
    builds.build_claim(build_id=build.pk, source="worker:h100-host", output_dir="/x")
    builds.build_progress(build_id=build.pk, source="worker:h100-host", phase="converting")
    auditor = django_user_model.objects.create_superuser(username="auditor", password="pw")
    client.force_login(auditor)
    page = client.get(f"/admin/deployments/enginebuild/{build.pk}/change/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "build.requested" in text and "build.status" in text and "converting" in text
    assert f"user:{operator.username}" in text
    assert 'name="_save"' not in text  # read-only
    listing = client.get("/admin/deployments/enginebuild/?trtllm_version=0.16.0&compute_capability=9.0")
    assert listing.status_code == 200 and "llama" in listing.content.decode()


def test_model_pages_offer_the_build_form_for_llms_and_the_deploy_form_otherwise(client, operator, llama, minilm):
    client.force_login(operator)
    llm_page = client.get(f"/models/{llama.pk}/").content.decode()
    assert llm_page.count('id="build-form"') == 1 and llm_page.count('id="deploy-form"') == 1
    assert f'<option value="{IMAGE}">' in llm_page
    assert 'name="engine_build"' in llm_page  # an llm is deployed from one of its builds
    embedder_page = client.get(f"/models/{minilm.pk}/").content.decode()
    assert embedder_page.count('id="deploy-form"') == 1 and 'id="build-form"' not in embedder_page


def test_build_form_queues_a_build_and_shows_its_page(client, operator, llama):
    client.force_login(operator)
    form = {"build": "1", "host": "h100-host", "image": IMAGE, "dtype": "float16", "quantization": "none",
            "gemm_plugin": "auto", "gpt_attention_plugin": "auto", "paged_context_fmha": "on", "max_batch_size": 8,
            "max_input_len": 1024, "max_seq_len": 2048, "max_num_tokens": 8192, "tp_size": 1, "pp_size": 1,
            "workers": 1}  # fmt: skip
    response = client.post(f"/models/{llama.pk}/", form)
    build = EngineBuild.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/builds/{build.pk}/"
    page = client.get(f"/builds/{build.pk}/").content.decode()
    assert "Gantry.buildPage" in page and "TensorRT-LLM 0.16.0" in page
    refused = client.post(f"/models/{llama.pk}/", {**form, "max_seq_len": 100000})
    assert "exceeds the checkpoint&#x27;s max_position_embeddings" in refused.content.decode()


def test_build_on_a_gpu_other_than_requested_fails_before_compiling(llama, operator, monkeypatch, settings, tmp_path):
    settings.GANTRY_DATA_DIR = tmp_path
    build, _ = request(operator)
    a100 = services.GpuReport(
        index=0, uuid="GPU-x", name="NVIDIA A100-SXM4-80GB", compute_capability="8.0", memory_total_bytes=80 << 30
    )
    monkeypatch.setattr(nvml, "read_inventory", lambda: nvml.Inventory(gpus=[a100]))
    builder.run_build(build.pk)
    build.refresh_from_db()
    assert build.status == BuildStatus.FAILED
    assert build.status_message.startswith(
        "GPU 0 is NVIDIA A100-SXM4-80GB (SM 8.0); the build was requested for NVIDIA H100 80GB HBM3 (SM 9.0)"
    )
