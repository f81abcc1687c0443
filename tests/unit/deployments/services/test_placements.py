"""Placement rules: engine gates, KV-cache planning, the LLM-API path, headroom."""

from __future__ import annotations

import re

import pytest
from django.utils import timezone

from common.errors import ValidationFailed
from deployments import selectors
from deployments.backends.memory import kv_bytes_per_token, kv_cache_tokens
from deployments.models import BuildStatus, EngineBuild, RegisteredModel
from deployments.services import deployments
from deployments.services.placements import PlacementSpec
from hosts.models import GpuHost
from tests import factories

DIGEST = "sha256:" + "ab" * 32


ENGINE_BYTES = 2_500_000_000


def _engine(model: RegisteredModel, host: GpuHost, **overrides) -> EngineBuild:  # noqa: ANN003
    values = {
        "model": model,
        "host": host,
        "spec": {"max_batch_size": 32, "max_seq_len": 2048, "max_beam_width": 1, "quantization": "none"},
        "builder_image": factories.IMAGE,
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
    values = {"runtime": "docker", "image": factories.IMAGE}
    values.update(placement.pop("deployment", {}))
    factories.surveyed()
    return deployments.deployment_create(
        name="stack",
        hosts=["h100-host"],
        placements=[
            PlacementSpec(**{"model": "llama", "engine_build": build.pk, "gpu_memory_fraction": 0.8, **placement}),
            PlacementSpec(model="mini", gpu_memory_fraction=0.1, gpu_ids=(0,)),
        ],
        user=operator,
        **values,
    )


@pytest.fixture
def mini(h100, minilm_path) -> RegisteredModel:
    return factories.registered_model(name="mini", kind="embedding", path=minilm_path, host=h100)


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
        f"was built in {factories.IMAGE}; serve it from that image"
        in _refusal(lambda: _deploy(llama, build, operator, deployment={"image": "other:1"}))["models[0].engine_build"][
            0
        ]
    )
    GpuHost.objects.filter(pk=h100.pk).update(builders={"images": {factories.IMAGE: "sha256:" + "cd" * 32}})
    assert (
        "an engine only loads in its own image"
        in _refusal(lambda: _deploy(llama, build, operator))["models[0].engine_build"][0]
    )
    GpuHost.objects.filter(pk=h100.pk).update(builders={"images": {factories.IMAGE: DIGEST}})
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


def test_an_llm_with_neither_engine_nor_llm_api_is_served_by_transformers(llama, operator):
    factories.surveyed()
    deployment = deployments.deployment_create(
        name="x",
        hosts=["h100-host"],
        placements=[PlacementSpec(model="llama", gpu_ids=(1,), gpu_memory_fraction=0.2)],
        user=operator,
    )
    placement = deployment.placements.get()
    assert (placement.backend, placement.instance_kind, placement.gpu_ids) == ("transformers", "auto", [1])
    assert placement.kv_cache_tokens is None


def test_an_llms_queue_delay_is_zero_unless_asked_and_the_sentence_models_keep_theirs(llama, mini, operator):
    """An LLM batches in flight: a batcher's delay would only hold a lone request's first token back."""
    factories.surveyed()
    deployment = deployments.deployment_create(
        name="x",
        hosts=["h100-host"],
        placements=[PlacementSpec(model="llama", gpu_ids=(1,), gpu_memory_fraction=0.2), PlacementSpec(model="mini")],
        user=operator,
    )
    delays = dict(deployment.placements.values_list("triton_name", "max_queue_delay_us"))
    assert delays == {"llama": 0, "mini": 2000}
    asked = deployments.deployment_create(
        name="y",
        hosts=["h100-host"],
        placements=[PlacementSpec(model="llama", gpu_ids=(1,), gpu_memory_fraction=0.2, max_queue_delay_us=700)],
        user=operator,
    )
    assert asked.placements.get().max_queue_delay_us == 700


def test_transformers_path_refuses_a_fraction_that_cannot_hold_the_weights(llama, operator):
    RegisteredModel.objects.filter(pk=llama.pk).update(parameter_count=8_000_000_000)
    errors = _refusal(
        lambda: deployments.deployment_create(
            name="x",
            hosts=["h100-host"],
            user=operator,
            placements=[PlacementSpec(model="llama", gpu_memory_fraction=0.1, decoupled=False)],
        )  # fmt: skip
    )
    assert errors["models[0].gpu_memory_fraction"] == [
        "0.1 of GPU 0's 80 GiB cannot hold llama's 14.90 GiB of weights, a KV cache of 4.12 GiB for 32 sequences "
        "of 4096 tokens and 0.34 GiB of activations (19.37 GiB in all)"
    ]
    assert errors["models[0].decoupled"] == [
        "the transformers path always streams (a decoupled model): leave decoupled on"
    ]


def test_auto_placements_on_a_host_without_gpus_must_fit_the_gpu_it_may_report(host, minilm, minilm_path, operator):
    """On the CPU today, on the host's first GPU once it reports one: 0.7 + 0.6 is refused."""
    factories.registered_model(name="rerank", kind="reranker", path=minilm_path, host=host)

    def create(embed: float, rerank: float):  # noqa: ANN202
        factories.surveyed()
        return deployments.deployment_create(
            name=f"auto-{int(embed * 100)}",
            hosts=[host.name],
            placements=[
                PlacementSpec(model="minilm", gpu_memory_fraction=embed),
                PlacementSpec(model="rerank", gpu_memory_fraction=rerank),
            ],
            user=operator,
        )

    with pytest.raises(ValidationFailed) as refused:
        create(0.7, 0.6)
    assert "add up to 1.3 > 1; lower them, or set instance_kind KIND_CPU" in refused.value.errors["models"][-1]
    assert create(0.5, 0.4).placements.count() == 2
