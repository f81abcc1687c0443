"""Serving engine builds: the tensorrtllm model configs checked against the
seeds' examples, the ensemble wiring, the engine gates, KV-cache planning and
the MPI launch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from django.utils import timezone
from tritonclient.grpc import model_config_pb2 as mc

from deployments import selectors, services
from deployments.errors import ValidationFailed
from deployments.models import BuildStatus, EngineBuild, GpuHost, RegisteredModel
from deployments.placement import kv_bytes_per_token, kv_cache_tokens
from tests.conftest import register_inspected
from tests.unit.test_builds import IMAGE, LLAMA, gpu_host_with, write_checkpoint
from workers.runtimes import LaunchSpec, server_command
from workers.triton.config import Batching, TrtllmSpec, parse_text, read_config, trtllm_configs
from workers.triton.repository import write_repository

SEEDS = Path(__file__).resolve().parents[3] / "shared" / "seeds"
DIGEST = "sha256:" + "ab" * 32
ENGINE_BYTES = 2_500_000_000


def _seed_config(seed: str, start: str, end: str, substitutions: dict[str, str]) -> mc.ModelConfig:
    text = (SEEDS / seed).read_text()
    block = text[text.index(start) + len(start) : text.index(end)]
    block = "\n".join(line for line in block.splitlines() if not line.startswith(("#", "LLM configuration")))
    for old, new in substitutions.items():
        block = block.replace(old, new)
    return parse_text(block)


def _spec(**overrides) -> TrtllmSpec:  # noqa: ANN003
    values = {
        "name": "llama",
        "engine_dir": "/data/builds/7/engine",
        "tokenizer_dir": "/models/llama",
        "batching": Batching(max_batch_size=32, preferred_batch_sizes=(32,), max_queue_delay_us=100),
        "gpu_device_ids": (0,),
        "max_tokens_in_paged_kv_cache": 20000,
    }
    return TrtllmSpec(**{**values, **overrides})


@pytest.fixture
def seed_configs() -> list[mc.ModelConfig]:
    if not SEEDS.is_dir():
        pytest.skip("the seeds are not beside this checkout")
    return [
        _seed_config(
            "002_79425276397cc8d5.txt",
            "triton_repo/gpt_oss_20b/config.pbtxt",
            "triton_repo/bge_reranker/config.pbtxt",
            {"__MAX_BATCH_SIZE_GPT__": "32", "__KV_CACHE_FRACTION__": "0.9"},
        ),
        # The seed writes TYPE_BYTES; Triton's schema calls that type TYPE_STRING.
        _seed_config(
            "004_c7c78437bd81929d.txt",
            "# llama3_8b/config.pbtxt",
            "Ensemble Pipeline for RAG",
            {"TYPE_BYTES": "TYPE_STRING"},
        ),
    ]


def test_engine_config_accepts_what_the_seeds_send(seed_configs):
    ours = trtllm_configs(_spec())["llama-engine"]
    assert parse_text(str(ours)) == ours  # what we write parses back to itself
    inputs = {t.name: t for t in ours.input}
    outputs = {t.name: t for t in ours.output}
    for seed in seed_configs:
        assert seed.backend == ours.backend == "tensorrtllm"
        for tensor in seed.input:
            if tensor.name == "sampling_config":
                continue  # not an input of the tensorrtllm backend's template
            assert inputs[tensor.name].data_type == tensor.data_type, tensor.name
            assert inputs[tensor.name].optional == tensor.optional, tensor.name
        for tensor in seed.output:
            assert outputs[tensor.name].data_type == tensor.data_type
        for key in ("executor_worker_path", "max_beam_width", "max_tokens_in_paged_kv_cache",
                    "kv_cache_free_gpu_mem_fraction"):  # fmt: skip
            if key in seed.parameters:
                assert key in ours.parameters, key
        if "executor_worker_path" in seed.parameters:
            assert ours.parameters["executor_worker_path"] == seed.parameters["executor_worker_path"]
    assert seed_configs[0].model_transaction_policy.decoupled and ours.model_transaction_policy.decoupled
    assert ours.parameters["kv_cache_free_gpu_mem_fraction"].string_value == "0.9"


def test_engine_config_follows_the_backend_template_where_the_seeds_simplify():
    config = trtllm_configs(_spec(gpu_device_ids=(0, 1), batch_scheduler_policy="max_utilization"))["llama-engine"]
    parameters = {k: v.string_value for k, v in config.parameters.items()}
    assert parameters["gpt_model_path"] == "/data/builds/7/engine"  # the seeds' "engine_dir"
    assert parameters["gpt_model_type"] == "inflight_fused_batching"
    assert parameters["batch_scheduler_policy"] == "max_utilization"  # the seeds' "scheduler_policy"
    assert parameters["gpu_device_ids"] == "0,1"
    assert parameters["max_tokens_in_paged_kv_cache"] == "20000"
    # The backend places the engine on gpu_device_ids; its instance group stays KIND_CPU.
    assert [(g.kind, list(g.gpus)) for g in config.instance_group] == [(mc.ModelInstanceGroup.KIND_CPU, [])]
    lengths = next(t for t in config.input if t.name == "input_lengths")
    assert lengths.HasField("reshape") and list(lengths.reshape.shape) == []
    assert next(t for t in config.input if t.name == "input_ids").allow_ragged_batch


def test_ensemble_wiring_is_complete():
    """What Triton checks when it loads an ensemble: every step reads tensors the
    ensemble has or an earlier step made, from inputs its model declares, and
    writes outputs its model declares; the ensemble's outputs are all produced."""
    configs = trtllm_configs(_spec())
    ensemble = configs["llama"]
    assert ensemble.platform == "ensemble"
    available = {t.name for t in ensemble.input}
    for step in ensemble.ensemble_scheduling.step:
        model = configs[step.model_name]
        declared_in = {t.name for t in model.input}
        declared_out = {t.name for t in model.output}
        assert set(step.input_map) <= declared_in, step.model_name
        assert set(step.input_map.values()) <= available, step.model_name
        required = {t.name for t in model.input if not t.optional}
        assert required <= set(step.input_map), (step.model_name, required - set(step.input_map))
        assert set(step.output_map) <= declared_out, step.model_name
        available |= set(step.output_map.values())
    assert {t.name for t in ensemble.output} <= available
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == [
        "llama-preprocessing", "llama-engine", "llama-postprocessing",
    ]  # fmt: skip


def test_repository_holds_the_four_models_with_the_tokenizer_code(tmp_path: Path):
    names = write_repository(tmp_path / "repo", [_spec()])
    assert names == ["llama-engine", "llama-preprocessing", "llama-postprocessing", "llama"]
    for name, config in trtllm_configs(_spec()).items():
        assert read_config(tmp_path / "repo" / name) == config
    assert (tmp_path / "repo" / "llama-preprocessing" / "1" / "model.py").is_file()
    assert not (tmp_path / "repo" / "llama-engine" / "1" / "model.py").exists()
    tokenizer_dir = read_config(tmp_path / "repo" / "llama-postprocessing").parameters["tokenizer_dir"]
    assert tokenizer_dir.string_value == "/models/llama"


# --- KV-cache planning ------------------------------------------------------------------


@pytest.fixture
def h100(db, settings) -> GpuHost:  # noqa: ANN001
    settings.GANTRY_BUILDER_IMAGES = {IMAGE: "0.16.0"}
    settings.GANTRY_ALLOWED_IMAGES = [IMAGE, "other:1"]
    return gpu_host_with("h100-host", "9.0", count=2)


@pytest.fixture
def llama(h100: GpuHost, tmp_path: Path) -> RegisteredModel:
    return register_inspected(name="llama", kind="llm", path=write_checkpoint(tmp_path / "llama", LLAMA), host=h100)


def _engine(model: RegisteredModel, host: GpuHost, **overrides) -> EngineBuild:  # noqa: ANN003
    values = {
        "model": model,
        "host": host,
        "spec": {"max_batch_size": 32, "max_seq_len": 2048, "max_beam_width": 1, "quantization": "none"},
        "builder_image": IMAGE,
        "image_digest": DIGEST,
        "trtllm_version": "0.16.0",
        "gpu_name": "NVIDIA H100 80GB HBM3",
        "compute_capability": "9.0",
        "status": BuildStatus.SUCCEEDED,
        "output_dir": "/data/builds/1/engine",
        "artifacts": [
            {"name": "config.json", "size": 4000, "sha256": "0"},
            {"name": "rank0.engine", "size": ENGINE_BYTES, "sha256": "1"},
        ],  # fmt: skip
        "cache_key": str(timezone.now().timestamp()),
        "finished_at": timezone.now(),
    }
    return EngineBuild.objects.create(**{**values, **overrides})


def test_kv_cache_tokens_come_from_the_checkpoint_shape(llama, h100):
    build = _engine(llama, h100)
    # 2 (K and V) x 16 layers x 8 KV heads x 64 head size x 2 bytes.
    assert kv_bytes_per_token(llama, build) == 32768
    memory = 80 * 2**30
    assert (
        kv_cache_tokens(model=llama, build=build, fraction=0.5, gpu_memory_bytes=memory)
        == int((0.5 * memory - ENGINE_BYTES) * 0.9) // 32768
    )
    fp8 = _engine(llama, h100, spec={**build.spec, "quantization": "fp8"}, cache_key="fp8")
    assert kv_bytes_per_token(llama, fp8) == 16384
    tp2 = _engine(llama, h100, tp_size=2, cache_key="tp2")
    assert kv_bytes_per_token(llama, tp2) == 16384


def _deploy(llama: RegisteredModel, build: EngineBuild, operator, **placement):  # noqa: ANN001, ANN003
    values = {"runtime": "docker", "image": IMAGE}
    values.update(placement.pop("deployment", {}))
    return services.deployment_create(
        name="stack",
        host_name="h100-host",
        placements=[
            services.PlacementSpec(
                **{"model": "llama", "engine_build": build.pk, "gpu_memory_fraction": 0.8, **placement}
            ),
            services.PlacementSpec(model="mini", gpu_memory_fraction=0.1, gpu_ids=(0,)),
        ],
        user=operator,
        **values,
    )


@pytest.fixture
def mini(h100, minilm_path) -> RegisteredModel:
    return register_inspected(name="mini", kind="embedding", path=minilm_path, host=h100)


def test_engine_deployment_is_planned_with_an_absolute_kv_budget(llama, mini, h100, operator, client):
    build = _engine(llama, h100)
    deployment = _deploy(llama, build, operator)
    engine = deployment.placements.get(triton_name="llama")
    assert engine.engine_build == build and engine.gpu_ids == [0] and engine.kv_cache_tokens > 2048
    gpu0 = selectors.deployment_plan(selectors.deployment_list().get(pk=deployment.pk))[0]
    row = next(m for m in gpu0["models"] if m["triton_name"] == "llama")
    assert row["engine_bytes"] == ENGINE_BYTES and row["kv_cache_tokens"] == engine.kv_cache_tokens
    assert gpu0["fraction"] == pytest.approx(0.9) and gpu0["within_headroom"]
    client.force_login(operator)
    assert "stack" in client.get(f"/builds/{build.pk}/").content.decode()  # where the build is deployed
    page = client.get(f"/deployments/{deployment.pk}/").content.decode()
    assert f"KV cache {engine.kv_cache_tokens} tokens" in page


def _refusal(callable_) -> dict:  # noqa: ANN001
    with pytest.raises(ValidationFailed) as caught:
        callable_()
    return caught.value.errors


def test_engine_built_for_sm80_is_refused_on_an_sm90_gpu(llama, mini, h100, operator):
    build = _engine(llama, h100, compute_capability="8.0", gpu_name="NVIDIA A100-SXM4-80GB")
    errors = _refusal(lambda: _deploy(llama, build, operator))
    assert errors["models[0].gpu_ids"] == [
        f"build {build.pk} was built for SM 8.0 (NVIDIA A100-SXM4-80GB); GPU 0 is NVIDIA H100 80GB HBM3 with SM 9.0"
    ]


def test_engine_gates_name_the_model_and_the_rule(llama, mini, h100, operator):
    build = _engine(llama, h100)
    assert (
        "engines run in the docker runtime"
        in _refusal(lambda: _deploy(llama, build, operator, deployment={"runtime": "process", "image": ""}))[
            "models[0].engine_build"
        ][0]
    )
    assert (
        f"was built in {IMAGE}; serve it from that image"
        in _refusal(lambda: _deploy(llama, build, operator, deployment={"image": "other:1"}))["models[0].engine_build"][
            0
        ]
    )
    GpuHost.objects.filter(pk=h100.pk).update(builders={"images": {IMAGE: "sha256:" + "cd" * 32}})
    assert (
        "an engine only loads in its own image"
        in _refusal(lambda: _deploy(llama, build, operator))["models[0].engine_build"][0]
    )
    GpuHost.objects.filter(pk=h100.pk).update(builders={"images": {IMAGE: DIGEST}})
    tp2 = _engine(llama, h100, tp_size=2, cache_key="tp2")
    assert _refusal(lambda: _deploy(llama, tp2, operator, gpu_ids=(0,)))["models[0].gpu_ids"] == [
        f"build {tp2.pk} is tp 2 x pp 1 = 2 GPUs; it is given 1"
    ]
    assert _refusal(lambda: _deploy(llama, build, operator, max_batch_size=64))["models[0].max_batch_size"] == [
        f"build {build.pk} was built for at most 32"
    ]
    small = _refusal(lambda: _deploy(llama, build, operator, gpu_memory_fraction=0.02))
    assert re.search(r"leaves room for \d+ KV-cache tokens", small["models[0].gpu_memory_fraction"][0])
    failed = _engine(llama, h100, status=BuildStatus.FAILED, cache_key="failed")
    assert (
        "only succeeded builds can be served"
        in _refusal(lambda: _deploy(llama, failed, operator))["models[0].engine_build"][0]
    )
    assert _refusal(lambda: _deploy(llama, build, operator, gpu_memory_fraction=0.9))["models"] == [
        "GPU 0: memory fractions add up to 1.00, above the headroom limit 0.95"
    ]


def test_multi_gpu_engine_runs_one_mpi_rank_per_gpu():
    spec = LaunchSpec(
        deployment_id=1, generation=1, repository=Path("/repo"), models=["llama-engine", "llama"], http_port=18000,
        grpc_port=18001, metrics_port=18002, log_path=Path("/log"), world_size=2, engine_models=["llama-engine"],
    )  # fmt: skip
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


# --- the no-build path ----------------------------------------------------------------------

NEWER = "tritonserver:25.06-trtllm-python-py3"


def _llm_api(operator, image: str, **placement):  # noqa: ANN001, ANN003
    return services.deployment_create(
        name="direct",
        host_name="h100-host",
        runtime="docker",
        image=image,
        placements=[
            services.PlacementSpec(**{"model": "llama", "llm_api": True, "gpu_memory_fraction": 0.5, **placement})
        ],
        user=operator,
    )


def test_checkpoint_is_served_through_the_llm_api_where_the_image_has_it(llama, operator, settings, tmp_path):
    settings.GANTRY_BUILDER_IMAGES = {IMAGE: "0.16.0", NEWER: "0.20.0"}
    settings.GANTRY_ALLOWED_IMAGES = [IMAGE, NEWER]
    errors = _refusal(lambda: _llm_api(operator, IMAGE))
    assert (
        f"{IMAGE} has no LLM-API backend Gantry knows of (TensorRT-LLM 0.16.0); images that have one: {NEWER}"
        in (errors["models[0].llm_api"][0])
    )
    deployment = _llm_api(operator, NEWER, gpu_ids=(0, 1))
    placement = deployment.placements.get()
    assert placement.backend == "llmapi" and placement.gpu_ids == [0, 1] and placement.kv_cache_tokens > 2048

    from workers import deployer

    specs = deployer.model_specs(selectors.deployment_list().get(pk=deployment.pk))
    write_repository(tmp_path / "repo", specs)
    folder = tmp_path / "repo" / "llama"
    assert (folder / "1").is_symlink() and str((folder / "1").readlink()) == "/app/all_models/llmapi/tensorrt_llm/1"
    args = json.loads((folder / "model.yaml").read_text())
    assert args["model"] == llama.path and args["backend"] == "pytorch" and args["tensor_parallel_size"] == 2
    assert args["kv_cache_config"]["max_tokens"] == placement.kv_cache_tokens
    assert args["triton_config"] == {"max_batch_size": 32, "decoupled": True}
    config = read_config(folder)
    assert config.backend == "python" and config.model_transaction_policy.decoupled
    env = deployer.launch_spec(selectors.deployment_list().get(pk=deployment.pk)).extra_env
    assert env == {"LLM_CONFIG_PATH": str(deployer.paths_for(deployment).repository / "llama" / "model.yaml")}


def test_llm_needs_an_engine_or_the_llm_api(llama, operator):
    errors = _refusal(
        lambda: services.deployment_create(
            name="x",
            host_name="h100-host",
            runtime="docker",
            image=IMAGE,
            placements=[services.PlacementSpec(model="llama")],
            user=operator,
        )  # fmt: skip
    )
    assert errors["models[0].engine_build"] == ["llama is an llm: name the engine build to serve, or set llm_api"]
