"""Rows into launch specs: engine and LLM-API model specs, MPI ranks, server environment."""

from __future__ import annotations

import json

import pytest

from common.errors import ValidationFailed
from deployments.services import deployments
from deployments.services.placements import PlacementSpec
from tests import factories
from triton_server.config import read_config
from triton_server.repository import write_repository
from workers.deploy import plan


def _refusal(callable_) -> dict:  # noqa: ANN001
    with pytest.raises(ValidationFailed) as caught:
        callable_()
    return caught.value.errors


NEWER = "tritonserver:25.06-trtllm-python-py3"


def _llm_api(operator, image: str, **placement):  # noqa: ANN001, ANN003
    factories.surveyed()
    return deployments.deployment_create(
        name="direct",
        hosts=["h100-host"],
        runtime="docker",
        image=image,
        placements=[PlacementSpec(**{"model": "llama", "llm_api": True, "gpu_memory_fraction": 0.5, **placement})],
        user=operator,
    )


def test_checkpoint_is_served_through_the_llm_api_where_the_image_has_it(llama, operator, settings, tmp_path):
    settings.GANTRY_BUILDER_IMAGES = {factories.IMAGE: "0.16.0", NEWER: "0.20.0"}
    settings.GANTRY_ALLOWED_IMAGES = [factories.IMAGE, NEWER]
    errors = _refusal(lambda: _llm_api(operator, factories.IMAGE))
    assert (
        f"{factories.IMAGE} has no LLM-API backend Gantry knows of (TensorRT-LLM 0.16.0); images that have one: {NEWER}"
        in (errors["models[0].llm_api"][0])
    )
    deployment = _llm_api(operator, NEWER, gpu_ids=(0, 1))
    placement = deployment.placements.get()
    assert placement.backend == "llmapi" and placement.gpu_ids == [0, 1] and placement.kv_cache_tokens > 2048

    specs = plan.model_specs(factories.replica_for(deployment))
    write_repository(tmp_path / "repo", specs)
    folder = tmp_path / "repo" / "llama"
    assert (folder / "1").is_symlink() and str((folder / "1").readlink()) == "/app/all_models/llmapi/tensorrt_llm/1"
    args = json.loads((folder / "model.yaml").read_text())
    assert args["model"] == llama.path and args["backend"] == "pytorch" and args["tensor_parallel_size"] == 2
    assert args["kv_cache_config"]["max_tokens"] == placement.kv_cache_tokens
    assert args["triton_config"] == {"max_batch_size": 32, "decoupled": True}
    config = read_config(folder)
    assert config.backend == "python" and config.model_transaction_policy.decoupled
    env = plan.launch_spec(factories.replica_for(deployment)).extra_env
    assert env["LLM_CONFIG_PATH"] == str(
        plan.paths_for(factories.replica_for(deployment)).repository / "llama" / "model.yaml"
    )


def test_the_llm_api_takes_the_lowest_gpus_of_its_container(llama, h100, minilm_path, operator, settings):
    """TensorRT-LLM's LLM() takes no device ids: its ranks take the first GPUs the
    container sees. Placed above another model's GPU, it would run on that one."""
    settings.GANTRY_BUILDER_IMAGES = {NEWER: "0.20.0"}
    settings.GANTRY_ALLOWED_IMAGES = [NEWER]
    factories.registered_model(name="embed", kind="embedding", path=minilm_path, host=h100)

    def beside(llm_gpu: int, embed_gpu: int):  # noqa: ANN202
        factories.surveyed()
        return deployments.deployment_create(
            name=f"llm-on-{llm_gpu}",
            hosts=[h100.name],
            runtime="docker",
            image=NEWER,
            placements=[
                PlacementSpec(model="llama", llm_api=True, gpu_ids=(llm_gpu,), gpu_memory_fraction=0.5),
                PlacementSpec(model="embed", instance_kind="KIND_GPU", gpu_ids=(embed_gpu,), gpu_memory_fraction=0.1),
            ],
            user=operator,
        )

    errors = _refusal(lambda: beside(1, 0))
    assert "runs on the first 1 GPU(s) its container sees, here [0]" in errors["models[0].gpu_ids"][0]
    deployment = beside(0, 1)
    specs = {spec.name: spec for spec in plan.model_specs(factories.replica_for(deployment))}
    assert specs["llama"].gpu_device_ids == (0,)


@pytest.mark.parametrize(("runtime", "image", "seen"), [("docker", "triton:test", (0, 1)), ("process", "", (2, 3))])
def test_a_placement_on_host_gpus_2_and_3_runs_on_them_whatever_the_runtime(
    minilm, operator, settings, runtime, image, seen
):
    settings.GANTRY_ALLOWED_IMAGES = ["triton:test"]
    quad = factories.gpu_host("quad", count=4)
    factories.surveyed()
    created = deployments.deployment_create(
        name="pinned",
        hosts=[quad.name],
        runtime=runtime,
        image=image,
        placements=[PlacementSpec(model="minilm", instance_kind="KIND_GPU", gpu_ids=(2, 3), gpu_memory_fraction=0.2)],
        user=operator,
    )
    replica = factories.replica_for(created)
    [spec] = plan.model_specs(replica)
    # Docker hands the container host GPUs 2 and 3 as its GPUs 0 and 1; a process sees the host's numbering.
    assert spec.instances.gpus == seen
    assert plan.launch_spec(replica).gpu_ids == (2, 3)


@pytest.mark.parametrize(("runtime", "image", "seen"), [("docker", "triton:test", (0, 1)), ("process", "", (3, 1))])
def test_a_replica_maps_the_deployments_gpus_onto_the_ones_its_host_gave_it(
    minilm, operator, settings, runtime, image, seen
):
    settings.GANTRY_ALLOWED_IMAGES = ["triton:test"]
    quad = factories.gpu_host("quad", count=4)
    factories.surveyed()
    created = deployments.deployment_create(
        name="mapped",
        hosts=[quad.name],
        runtime=runtime,
        image=image,
        placements=[PlacementSpec(model="minilm", instance_kind="KIND_GPU", gpu_ids=(0, 1), gpu_memory_fraction=0.2)],
        user=operator,
    )
    replica = factories.replica_for(created, gpu_map={0: 3, 1: 1})
    [spec] = plan.model_specs(replica)
    # The deployment's GPUs 0 and 1 are this host's 3 and 1; a container sees them as its 1 and 0.
    assert spec.instances.gpus == (seen if runtime == "process" else (1, 0))
    assert plan.launch_spec(replica).gpu_ids == (1, 3)


def test_a_replicas_threads_are_its_share_of_the_host_s_cores(host, gpu_host, minilm, operator, monkeypatch):
    monkeypatch.setattr(plan.os, "sched_getaffinity", lambda pid: set(range(8)))  # the host's cores

    def started(name: str, where, count: int, **placement) -> list:  # noqa: ANN001, ANN003
        factories.surveyed()
        deployment = deployments.deployment_create(
            name=name, hosts=[where.name], replicas=count, placements=[PlacementSpec(model="minilm", **placement)],
            user=operator,
        )  # fmt: skip
        deployments.deployment_start(deployment_id=deployment.pk, user=operator)
        return [plan.load(r.pk) for r in deployment.replica_set.order_by("serial")]

    # Two CPU replicas on 8 cores: 4 threads each; one of two instances: 2 each, in every pool's variable.
    first, _ = started("cpu", host, 2)
    assert plan.replica_threads(first) == 4
    assert {plan.launch_spec(first).extra_env[name] for name in plan.THREAD_VARIABLES} == {"4"}
    [doubled] = started("doubled", host, 1, instance_count=2)
    assert plan.replica_threads(doubled) == 8 // 3 // 2
    # Beside a GPU, a small pool whatever the cores.
    [gpu] = started("gpu", gpu_host, 1, instance_kind="KIND_GPU", gpu_memory_fraction=0.3)
    assert plan.replica_threads(gpu) == plan.GPU_SIDE_THREADS
    # The host's operator may fix it in the worker's environment.
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert plan.replica_threads(first) == 3


def test_an_image_pull_goes_on_the_replicas_timeline_as_it_starts_then_every_few_seconds_and_when_done(
    host, minilm, operator
):  # noqa: ANN001
    from core.models import Event
    from workers.runtimes.docker import PullProgress

    replica = factories.replica_of(factories.deployment_in(factories.deployment(host=host, user=operator), "launching"))
    clock = iter([100.0, 101.0, 106.0, 107.0])
    notes = plan.PullNotes(replica.pk, clock=lambda: next(clock))
    for done in (0, 10, 60):  # the first, one within NOTE_EVERY_S (left out), one after it
        notes(PullProgress("repo/triton:1", done * 1_000_000, 100_000_000, 0, 2))
    notes(PullProgress("repo/triton:1", 100_000_000, 100_000_000, 2, 2))  # done: always said
    said = list(Event.objects.filter(kind="replica.image_pull").order_by("id").values_list("message", flat=True))
    assert said == [
        "r1 on cpu-host: pulling repo/triton:1: 0 of 100 MB (0 %), 0 of 2 layers",
        "r1 on cpu-host: pulling repo/triton:1: 60 of 100 MB (60 %), 0 of 2 layers",
        "r1 on cpu-host: pulling repo/triton:1: 100 of 100 MB (100 %), 2 of 2 layers",
    ]
