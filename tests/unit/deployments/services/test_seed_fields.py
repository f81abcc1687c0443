"""Every knob the seeds turn is a validated placement or server field: the KV
cache's share or absolute tokens, sequences in flight, KV reuse, decoding mode,
the queue's timeout action, sentence models' precision, length and remote
code, shared memory and log verbosity; each refused by name, with the reason,
where the path or the TensorRT-LLM release does not take it; gpt-oss goes to
the LLM API of a release that serves it."""

from __future__ import annotations

import json

import pytest
from django.utils import timezone

from common.errors import ValidationFailed
from deployments import selectors
from deployments.models import BuildStatus, EngineBuild, RegisteredModel
from deployments.services import builds, deployments
from deployments.services.deployments import ServerSpec
from deployments.services.placements import PlacementSpec
from hosts.models import GpuHost
from tests import factories
from triton_server.config import read_config
from triton_server.repository import write_repository
from triton_server.server import tritonserver_args
from workers.deploy import plan
from workers.runtimes.docker import run_options

NEWER = "tritonserver:25.06-trtllm-python-py3"
GPT_OSS_IMAGE = "tritonserver:25.10-trtllm-python-py3"


def _refusal(callable_) -> dict:  # noqa: ANN001
    with pytest.raises(ValidationFailed) as caught:
        callable_()
    return caught.value.errors


def _engine(model: RegisteredModel, host: GpuHost, **spec) -> EngineBuild:  # noqa: ANN003
    return EngineBuild.objects.create(
        model=model,
        host=host,
        builder_image=factories.IMAGE,
        image_digest=factories.IMAGE_DIGEST,
        trtllm_version="0.16.0",
        gpu_name=factories.H100,
        compute_capability="9.0",
        status=BuildStatus.SUCCEEDED,
        spec={
            "max_batch_size": 32,
            "max_seq_len": 2048,
            "max_beam_width": 1,
            "quantization": "none",
            "dtype": "float16",
            "paged_context_fmha": True,
            **spec,
        },
        output_dir="/data/builds/1/engine",
        cache_key=str(timezone.now().timestamp()),
        finished_at=timezone.now(),
        artifacts=[{"name": "rank0.engine", "size": 2_500_000_000, "sha256": "1"}],
    )


def _create(operator, *specs: PlacementSpec, runtime: str = "docker", image: str = factories.IMAGE, **more):  # noqa: ANN001, ANN003
    factories.surveyed()
    return deployments.deployment_create(
        name="stack",
        hosts=["h100-host"],
        runtime=runtime,
        image=image,
        placements=list(specs),
        user=operator,
        **more,
    )


def test_the_seeds_engine_settings_reach_its_config(llama, h100, operator, tmp_path):
    build = _engine(llama, h100)
    deployment = _create(
        operator,
        PlacementSpec(
            model="llama",
            engine_build=build.pk,
            gpu_memory_fraction=0.8,
            kv_cache_free_gpu_mem_fraction=0.92,
            enable_kv_cache_reuse=True,
            decoding_mode="top_k_top_p",
            queue_timeout_us=1000,
            timeout_action="DELAY",
        ),
        server=ServerSpec(shm_size_mib=16384, log_verbose=1),
    )
    placement = deployment.placements.get()
    # The KV budget is the 0.92 share of what the fraction leaves after the engine.
    memory = 80 << 30
    assert placement.kv_cache_tokens == int((0.8 * memory - 2_500_000_000) * 0.92) // 32768
    write_repository(tmp_path / "repo", plan.model_specs(factories.replica_for(deployment)))
    parameters = {k: v.string_value for k, v in read_config(tmp_path / "repo" / "llama-engine").parameters.items()}
    assert parameters["kv_cache_free_gpu_mem_fraction"] == "0.92"
    assert parameters["enable_kv_cache_reuse"] == "true" and parameters["decoding_mode"] == "top_k_top_p"
    assert parameters["max_tokens_in_paged_kv_cache"] == str(placement.kv_cache_tokens)
    generate = read_config(tmp_path / "repo" / "llama")
    assert generate.dynamic_batching.default_queue_policy.timeout_action == 1  # DELAY
    spec = plan.launch_spec(factories.replica_for(deployment))
    assert "--log-verbose=1" in tritonserver_args(spec)
    assert run_options(spec, "h100-host")["shm_size"] == "16384m"


def test_an_absolute_kv_budget_must_fit_the_fraction_and_hold_a_sequence(llama, h100, operator):
    build = _engine(llama, h100)
    tokens = 100_000
    deployment = _create(
        operator,
        PlacementSpec(
            model="llama", engine_build=build.pk, gpu_memory_fraction=0.8, max_tokens_in_paged_kv_cache=tokens
        ),
    )
    assert deployment.placements.get().kv_cache_tokens == tokens
    deployment.delete()
    too_many = _refusal(
        lambda: _create(
            operator,
            PlacementSpec(
                model="llama", engine_build=build.pk, gpu_memory_fraction=0.1, max_tokens_in_paged_kv_cache=10_000_000
            ),
        )
    )
    assert too_many["models[0].max_tokens_in_paged_kv_cache"][0].startswith("10000000 tokens do not fit: 0.1 of 80 GiB")
    too_few = _refusal(
        lambda: _create(
            operator,
            PlacementSpec(
                model="llama", engine_build=build.pk, gpu_memory_fraction=0.8, max_tokens_in_paged_kv_cache=100
            ),
        )
    )
    assert too_few["models[0].max_tokens_in_paged_kv_cache"] == ["must hold at least one 2048-token sequence"]


def test_engine_settings_its_release_or_build_does_not_take_are_refused_with_the_reason(llama, h100, operator):
    build = _engine(llama, h100, paged_context_fmha=False)
    errors = _refusal(
        lambda: _create(
            operator,
            PlacementSpec(
                model="llama",
                engine_build=build.pk,
                gpu_memory_fraction=0.8,
                max_num_sequences=256,
                max_seq_len=4096,
                dtype="float16",
                decoding_mode="beam_search",
                enable_kv_cache_reuse=True,
            ),
        )
    )
    assert errors["models[0].max_num_sequences"] == [
        "the tensorrtllm backend of TensorRT-LLM 0.16.0 reads no max_num_sequences: the sequences in flight are "
        f"bounded by the engine's max_batch_size (32 for build {build.pk}); build with another max_batch_size to "
        "change it"
    ]
    assert errors["models[0].max_seq_len"] == [
        f"an engine's max_seq_len is set when it is built (2048 for build {build.pk}); leave it empty"
    ]
    assert errors["models[0].dtype"] == ["an engine runs in the dtype it was built with (float16); leave it auto"]
    assert errors["models[0].decoding_mode"] == [
        f"beam_search needs an engine built with max_beam_width above 1 (build {build.pk})"
    ]
    assert errors["models[0].enable_kv_cache_reuse"] == [
        f"KV-cache reuse needs an engine built with paged context FMHA; build {build.pk} was built without"
    ]


def test_tensorrt_llm_settings_are_refused_on_the_sentence_and_transformers_paths(gpu_host, minilm, operator):
    errors = _refusal(
        lambda: deployments.deployment_create(
            name="s",
            hosts=["gpu-host"],
            user=operator,
            placements=[
                PlacementSpec(
                    model="minilm",
                    kv_cache_free_gpu_mem_fraction=0.9,
                    max_tokens_in_paged_kv_cache=100,
                    enable_kv_cache_reuse=True,
                    decoding_mode="top_k",
                    max_num_sequences=4,
                    timeout_action="DELAY",
                )
            ],
        )
    )
    assert errors["models[0].kv_cache_free_gpu_mem_fraction"] == [
        "TensorRT-LLM's KV-cache share; an embedding model has none to set"
    ]
    assert errors["models[0].max_tokens_in_paged_kv_cache"] == [
        "TensorRT-LLM's paged KV cache; an embedding model has none"
    ]
    assert errors["models[0].enable_kv_cache_reuse"] == [
        "TensorRT-LLM's KV-cache reuse; an embedding model cannot reuse a cache"
    ]
    assert errors["models[0].decoding_mode"] == [
        "the tensorrtllm backend's decoding mode; an embedding model samples per request"
    ]
    assert errors["models[0].max_num_sequences"] == [
        "an embedding model generates no sequences: max_batch_size bounds a batch"
    ]
    assert errors["models[0].timeout_action"] == [
        "DELAY acts on requests past queue_timeout_us: set a queue timeout too"
    ]


def test_sentence_models_take_16_bits_on_a_gpu_and_a_length_up_to_their_positions(gpu_host, host, minilm, operator):
    factories.surveyed()
    deployment = deployments.deployment_create(
        name="fp16",
        hosts=["gpu-host"],
        user=operator,
        placements=[PlacementSpec(model="minilm", dtype="float16", max_seq_len=512, gpu_memory_fraction=0.05)],
    )
    placement = deployment.placements.get()
    assert (placement.dtype, placement.max_seq_len) == ("float16", 512)
    [spec] = plan.model_specs(factories.replica_for(deployment))
    assert (spec.dtype, spec.max_seq_len, spec.trust_remote_code) == ("float16", 512, False)
    longer = _refusal(
        lambda: deployments.deployment_create(
            name="long",
            hosts=["gpu-host"],
            user=operator,
            placements=[PlacementSpec(model="minilm", max_seq_len=1024)],
        )
    )
    assert longer["models[0].max_seq_len"] == ["must be at most 512, minilm's max_position_embeddings"]
    on_cpu = _refusal(
        lambda: deployments.deployment_create(
            name="cpu",
            hosts=["gpu-host"],
            user=operator,
            placements=[PlacementSpec(model="minilm", dtype="float16", instance_kind="KIND_CPU")],
        )
    )
    assert on_cpu["models[0].dtype"] == ["float16 runs on a GPU; these instances run on the CPU (use float32 or auto)"]
    old = factories.gpu_host("t4-host", cc="7.5", gpu_name="Tesla T4")
    factories.registered_model(name="mini-t4", kind="embedding", path=minilm.path, host=old)
    bf16 = _refusal(
        lambda: deployments.deployment_create(
            name="bf16",
            hosts=["t4-host"],
            user=operator,
            placements=[PlacementSpec(model="mini-t4", dtype="bfloat16")],
        )
    )
    assert bf16["models[0].dtype"] == ["bfloat16 needs compute capability 8.0; GPU 0 is 7.5"]


def test_transformers_sequences_in_flight_and_length_are_planned_and_bounded(llama, operator):
    factories.surveyed()
    deployment = deployments.deployment_create(
        name="t",
        hosts=["h100-host"],
        user=operator,
        placements=[
            PlacementSpec(
                model="llama",
                gpu_ids=(0,),
                gpu_memory_fraction=0.2,
                max_num_sequences=64,
                max_seq_len=1024,
                max_batch_size=16,
                dtype="bfloat16",
            )
        ],
    )
    [spec] = plan.model_specs(factories.replica_for(deployment))
    assert (spec.max_num_sequences, spec.max_seq_len, spec.dtype) == (64, 1024, "bfloat16")
    [gpu] = selectors.deployment_plan(selectors.deployment_list().get(pk=deployment.pk))
    assert gpu["models"][0]["kv_cache_bytes"] == 65 * 1024 * 32768  # one slot per sequence and a scratch one
    errors = _refusal(
        lambda: deployments.deployment_create(
            name="u",
            hosts=["h100-host"],
            user=operator,
            placements=[PlacementSpec(model="llama", max_num_sequences=4, max_batch_size=8, max_seq_len=8192)],
        )
    )
    assert errors["models[0].max_num_sequences"] == ["must be at least max_batch_size (8): a batch joins at once"]
    assert errors["models[0].max_seq_len"] == ["must be at most 4096, llama's max_position_embeddings"]


def test_llm_api_takes_the_seeds_kv_share_reuse_and_sequences(llama, operator, settings, tmp_path):
    settings.GANTRY_BUILDER_IMAGES = {factories.IMAGE: "0.16.0", NEWER: "0.20.0"}
    settings.GANTRY_ALLOWED_IMAGES = [factories.IMAGE, NEWER]
    deployment = _create(
        operator,
        PlacementSpec(
            model="llama",
            llm_api=True,
            gpu_memory_fraction=0.5,
            kv_cache_free_gpu_mem_fraction=0.92,
            enable_kv_cache_reuse=True,
            max_num_sequences=256,
            max_seq_len=2048,
        ),
        image=NEWER,
    )
    write_repository(tmp_path / "repo", plan.model_specs(factories.replica_for(deployment)))
    args = json.loads((tmp_path / "repo" / "llama" / "model.yaml").read_text())
    assert args["max_batch_size"] == 256 and args["max_seq_len"] == 2048
    assert args["kv_cache_config"]["free_gpu_memory_fraction"] == 0.92
    assert args["kv_cache_config"]["enable_block_reuse"] is True


GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
}


def test_gpt_oss_goes_to_the_llm_api_of_a_release_that_serves_it(h100, operator, settings, tmp_path):
    settings.GANTRY_BUILDER_IMAGES = {factories.IMAGE: "0.16.0", NEWER: "0.20.0", GPT_OSS_IMAGE: "1.0.0"}
    settings.GANTRY_ALLOWED_IMAGES = list(settings.GANTRY_BUILDER_IMAGES)
    GpuHost.objects.filter(pk=h100.pk).update(
        builders={"images": {image: factories.IMAGE_DIGEST for image in settings.GANTRY_BUILDER_IMAGES}}
    )
    factories.registered_model(
        name="gpt-oss", kind="llm", path=factories.write_checkpoint(tmp_path / "oss", GPT_OSS), host=h100
    )
    older = _refusal(
        lambda: _create(operator, PlacementSpec(model="gpt-oss", llm_api=True, gpu_memory_fraction=0.5), image=NEWER)
    )
    assert older["models[0].model"] == [
        "architecture GptOssForCausalLM is not one TensorRT-LLM 0.20.0 serves; TensorRT-LLM 1.0.0 and later do"
    ]
    deployment = _create(
        operator, PlacementSpec(model="gpt-oss", llm_api=True, gpu_memory_fraction=0.5), image=GPT_OSS_IMAGE
    )
    assert deployment.placements.get().backend == "llmapi"
    # No engine build: trtllm-build has no converter for it, whatever the release.
    with pytest.raises(ValidationFailed) as refused:
        builds.build_request(model="gpt-oss", host="h100-host", image=GPT_OSS_IMAGE, spec={}, user=operator)
    assert refused.value.errors["model"] == [
        "gpt-oss has no engine build in TensorRT-LLM (trtllm-build has no converter for it): deploy the checkpoint "
        "through the LLM API (llm_api), with TensorRT-LLM 1.0.0 or later"
    ]


def test_server_settings_are_checked_and_changed_by_restart(gpu_host, minilm, operator, api):
    refused = _refusal(
        lambda: deployments.deployment_create(
            name="p",
            hosts=["gpu-host"],
            user=operator,
            placements=[PlacementSpec(model="minilm")],
            server=ServerSpec(shm_size_mib=16384),
        )
    )
    assert refused["shm_size_mib"] == [
        "the process runtime's server uses the host's /dev/shm: this is the docker runtime's"
    ]
    created = api.post(
        "/api/deployments/",
        {"name": "v", "host": "gpu-host", "log_verbose": 2, "models": [{"model": "minilm"}]},
        format="json",
    )
    assert created.status_code == 201 and created.data["log_verbose"] == 2
    bad = api.patch(f"/api/deployments/{created.data['id']}/", {"log_verbose": 9}, format="json")
    assert bad.status_code == 400 and "log_verbose" in bad.data["errors"]
    at_rest = api.patch(f"/api/deployments/{created.data['id']}/", {"log_verbose": 0}, format="json")
    assert at_rest.status_code == 202 and at_rest.data["log_verbose"] == 0 and at_rest.data["status"] == "pending"
    running = factories.deployment_in(
        selectors.deployment_list().get(pk=created.data["id"]), "launching", "loading", "ready"
    )
    restarted = api.patch(f"/api/deployments/{running.pk}/", {"log_verbose": 1}, format="json")
    assert restarted.status_code == 202 and restarted.data["status"] == "stopping"
    assert restarted.data["desired_state"] == "running"  # the stop task starts it again with the new settings
