"""One GPU plan per host: shares are fractions times instances, every server
process holds a context, the transformers LLM's KV cache is planned, and a
start or change that would pass the headroom beside the host's other
deployments is refused, naming them."""

from __future__ import annotations

import pytest

from common.errors import InvalidTransition, ValidationFailed
from deployments import selectors
from deployments.backends.transformers import transformers_needs
from deployments.models import Deployment, DeploymentStatus, RegisteredModel
from deployments.services import deployments
from deployments.services.placements import PlacementSpec
from tests import factories


def _create(name: str, operator, fraction: float, **placement) -> Deployment:  # noqa: ANN001, ANN003
    factories.surveyed()
    return deployments.deployment_create(
        name=name,
        hosts=["gpu-host"],
        placements=[PlacementSpec(model="minilm", gpu_ids=(0,), gpu_memory_fraction=fraction, **placement)],
        user=operator,
    )


def test_two_deployments_of_080_on_one_gpu_the_second_start_is_refused_naming_the_first(gpu_host, minilm, operator):
    first = _create("first", operator, 0.8)
    second = _create("second", operator, 0.8)  # nothing runs yet: creating it is fine
    deployments.deployment_start(deployment_id=first.pk, user=operator)
    with pytest.raises(InvalidTransition) as refused:
        deployments.deployment_start(deployment_id=second.pk, user=operator)
    assert str(refused.value) == (
        "second's replica 1 of 1 fits on no host (gpu-host): gpu-host is short by 0.65 of GPU 0's memory: "
        "GPU 0: memory fractions add up to 1.60 together with first r1 (launching), above the headroom limit 0.95"
    )
    second_row = Deployment.objects.get(pk=second.pk)
    assert (second_row.status, second_row.desired_state, second_row.replica_set.count()) == ("pending", "stopped", 0)
    # The plan of either shows both, the other one's rows marked as not its own.
    [gpu] = selectors.deployment_plan(selectors.deployment_list().get(pk=second.pk))
    assert [(m["deployment"], m["own"]) for m in gpu["models"]] == [("second", True), ("first r1", False)]
    assert gpu["fraction"] == pytest.approx(1.6) and not gpu["within_headroom"]
    # Once the first is stopped for good, the second starts.
    Deployment.objects.filter(pk=first.pk).update(status=DeploymentStatus.STOPPED, desired_state="stopped")
    first.replica_set.update(status=DeploymentStatus.STOPPED, desired_state="stopped")
    deployments.deployment_start(deployment_id=second.pk, user=operator)


def test_a_running_change_is_checked_against_the_hosts_other_deployments(gpu_host, minilm, operator):
    other = _create("other", operator, 0.5)
    deployments.deployment_start(deployment_id=other.pk, user=operator)
    mine = factories.deployment_in(_create("mine", operator, 0.2), "launching", "loading", "ready")
    with pytest.raises(ValidationFailed) as refused:
        deployments.deployment_change(
            deployment_id=mine.pk,
            placements=[PlacementSpec(model="minilm", gpu_ids=(0,), gpu_memory_fraction=0.6)],
            user=operator,
        )
    assert refused.value.errors["models"] == [
        "r1 on gpu-host: GPU 0: memory fractions add up to 1.10 together with other r1 (launching), "
        "above the headroom limit 0.95"
    ]


def test_each_instance_is_a_process_with_its_own_share(gpu_host, minilm, operator):
    deployment = _create("d", operator, 0.2, instance_count=3)
    [gpu] = selectors.deployment_plan(selectors.deployment_list().get(pk=deployment.pk))
    [row] = gpu["models"]
    assert (row["fraction"], row["instances"], row["share"], row["processes"]) == (0.2, 3, pytest.approx(0.6), 3)
    assert gpu["processes"] == 4  # three stubs and tritonserver
    with pytest.raises(ValidationFailed) as refused:
        _create("e", operator, 0.4, instance_count=3)
    assert refused.value.errors["models"] == ["GPU 0: memory fractions add up to 1.20, above the headroom limit 0.95"]


def test_what_the_shares_leave_must_hold_every_processs_context(gpu_host, minilm, operator, settings):
    settings.GANTRY_GPU_PROCESS_RESERVE_MIB = 4096  # 4 GiB a process: four of them need 16 of the 79.6
    with pytest.raises(ValidationFailed) as refused:
        _create("d", operator, 0.28, instance_count=3)
    assert refused.value.errors["models"] == [
        "GPU 0: 4 server processes need 16.0 GiB for their CUDA contexts (4096 MiB each, "
        "GANTRY_GPU_PROCESS_RESERVE_MIB), but the fractions leave 12.7 GiB"
    ]


def test_the_dashboard_bar_counts_instances(client, gpu_host, minilm, operator):
    deployment = _create("d", operator, 0.2, instance_count=2)
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    shares = selectors.gpu_shares_on([gpu_host])
    assert [s["fraction"] for s in shares[(gpu_host.pk, 0)]] == [pytest.approx(0.4)]


def test_the_transformers_kv_cache_is_planned_from_sequences_and_length(llama):
    RegisteredModel.objects.filter(pk=llama.pk).update(parameter_count=1_000_000_000)
    llama.refresh_from_db()
    needs = transformers_needs(llama, max_num_sequences=8, max_seq_len=1024)
    # One slot cache: 8 sequences (and a scratch slot) x 1024 tokens x (2 x 16 layers x 8 KV heads x 64 x 2 bytes).
    assert needs.kv_cache == 9 * 1024 * 32768
    assert needs.weights == 2_000_000_000
    assert needs.activations > 0
    # A sliding window shorter than the context: the model's own growing cache, planned twice.
    RegisteredModel.objects.filter(pk=llama.pk).update(config={**llama.config, "sliding_window": 512})
    llama.refresh_from_db()
    assert transformers_needs(llama, max_num_sequences=8, max_seq_len=1024).kv_cache == 2 * 8 * 1024 * 32768
    assert transformers_needs(llama, max_num_sequences=8, max_seq_len=512).kv_cache == 9 * 512 * 32768


def test_the_preflight_of_a_change_leaves_the_changed_deployments_own_models_out(api, gpu_host, minilm, operator):
    deployment = _create("d", operator, 0.6)
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    body = {"name": "", "host": "gpu-host", "replaces": deployment.pk,
            "models": [{"model": "minilm", "gpu_ids": [0], "gpu_memory_fraction": 0.7}]}  # fmt: skip
    answer = api.post("/api/deployments/preflight/", body, format="json").data
    assert answer["valid"] and answer["warnings"] == []
    assert [m["share"] for m in answer["plan"][0]["models"]] == [0.7]
    # A new deployment beside it is warned about: it would be refused at start.
    body.pop("replaces")
    answer = api.post("/api/deployments/preflight/", body, format="json").data
    assert answer["valid"] and answer["warnings"] == [
        "at start: replica 1: gpu-host is short by 0.35 of GPU 0's memory: GPU 0: memory fractions add up to 1.30 "
        "together with d r1 (launching), above the headroom limit 0.95"
    ]
    assert answer["replicas"][0]["host"] is None
