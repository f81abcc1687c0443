"""The build spec rules that need the checkpoint, the host and the release; each names
its field (spec.<name>, as the API names a spec's type errors)."""

from __future__ import annotations

import pytest

from common.errors import ValidationFailed
from deployments.models import EngineBuild
from deployments.services import builds
from hosts.models import GpuHost
from tests import factories
from workers.engines import executors


def request(operator, **spec):  # noqa: ANN001, ANN003, ANN201
    return builds.build_request(model="llama", host="h100-host", image=factories.IMAGE, spec=spec, user=operator)


def errors_of(call) -> dict:  # noqa: ANN001
    with pytest.raises(ValidationFailed) as caught:
        call()
    return caught.value.errors


def test_fp8_needs_compute_capability_8_9(db, operator, builder_images, tmp_path):
    a100 = factories.trtllm_host("a100-host", "8.0", gpu_name="NVIDIA A100-SXM4-80GB")
    factories.registered_model(
        name="llama", kind="llm", path=factories.write_checkpoint(tmp_path / "l", factories.LLAMA), host=a100
    )
    errors = errors_of(
        lambda: builds.build_request(
            model="llama", host="a100-host", image=factories.IMAGE, spec={"quantization": "fp8"}, user=operator
        )
    )
    assert errors == {
        "spec.quantization": ["fp8 needs compute capability 8.9 or higher; NVIDIA A100-SXM4-80GB has 8.0"]
    }
    assert EngineBuild.objects.count() == 0


def test_bfloat16_needs_ampere(db, operator, builder_images, tmp_path):
    t4 = factories.trtllm_host("t4-host", "7.5", gpu_name="Tesla T4")
    factories.registered_model(
        name="llama", kind="llm", path=factories.write_checkpoint(tmp_path / "l", factories.LLAMA), host=t4
    )
    errors = errors_of(
        lambda: builds.build_request(
            model="llama", host="t4-host", image=factories.IMAGE, spec={"dtype": "bfloat16"}, user=operator
        )
    )
    assert "bfloat16 needs compute capability 8.0" in errors["spec.dtype"][0]


def test_length_rules_name_their_fields(llama, operator):
    errors = errors_of(lambda: request(operator, max_input_len=4096, max_seq_len=2048))
    assert errors["spec.max_seq_len"] == ["must be at least max_input_len (4096)"]
    errors = errors_of(lambda: request(operator, max_seq_len=8192))
    assert "exceeds the checkpoint's max_position_embeddings (4096)" in errors["spec.max_seq_len"][0]
    build, how = request(operator, max_seq_len=8192, allow_seq_len_over_max_positions=True)
    assert how == "queued" and build.spec["max_seq_len"] == 8192


def test_parallelism_must_fit_the_host_and_the_model(llama, operator):
    assert errors_of(lambda: request(operator, tp_size=4))["spec.tp_size"] == [
        "tp_size * pp_size = 4 GPUs, but h100-host has 2"
    ]
    assert errors_of(lambda: request(operator, tp_size=2, gpu_ids=[0, 5]))["spec.gpu_ids"] == ["h100-host has no GPU 5"]
    assert errors_of(lambda: request(operator, workers=2))["spec.workers"] == ["must be at most tp_size * pp_size (1)"]
    build, _ = request(operator, tp_size=2, workers=2)
    assert build.gpu_ids == [0, 1] and build.world_size == 2


def test_unsupported_architecture_is_refused_with_the_supported_list(db, operator, h100, tmp_path):
    bert = {**factories.LLAMA, "architectures": ["BertModel"]}
    factories.registered_model(
        name="llama", kind="llm", path=factories.write_checkpoint(tmp_path / "b", bert), host=h100
    )
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
    assert errors_of(lambda: request(operator, max_batch=4)) == {"spec.max_batch": ["is not a build setting"]}


def test_a_host_whose_docker_cannot_be_asked_is_not_told_to_pull(llama, operator, settings, monkeypatch):  # noqa: ANN001
    """The agent's report of a Docker engine it cannot reach (a real client on a dead
    socket) says so, and a build there is refused with that cause, not "pull it"."""
    monkeypatch.setenv("DOCKER_HOST", "unix:///tmp/gantry-no-docker-here.sock")
    report = executors.builders_report()
    assert report["images"] == {} and report["docker_error"].startswith("Docker engine unreachable")
    GpuHost.objects.filter(name="h100-host").update(builders=report)
    errors = errors_of(lambda: request(operator))
    assert errors["image"] == [f"h100-host could not read its images: {report['docker_error']}"]
