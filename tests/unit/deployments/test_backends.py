"""The serving backends: one module and one registration each, the backend a
placement asks for, and the plan a replica is sent with and its host runs by."""

from __future__ import annotations

import pytest

from deployments import states
from deployments.backends import BACKENDS, backend_for
from deployments.backends.base import ServingBackend
from deployments.models import Backend, RegisteredModel, Replica
from deployments.models import DeploymentStatus as S
from deployments.services import deployments, generations, replicas
from deployments.services.placements import PlacementSpec
from tests import factories
from triton_server.config import Instances
from workers.deploy import plan


def test_every_backend_is_one_module_and_one_registration():
    assert sorted(backend.key for backend in BACKENDS) == sorted(Backend.values)
    modules = [type(backend).__module__ for backend in BACKENDS]
    assert len(set(modules)) == len(BACKENDS) and all(m.startswith("deployments.backends.") for m in modules)
    for backend in BACKENDS:  # what a backend must answer, it answers itself
        assert type(backend).check is not ServingBackend.check, backend.key
        assert type(backend).model_spec is not ServingBackend.model_spec, backend.key


@pytest.mark.parametrize(
    ("kind", "asked", "backend"),
    [
        ("llm", {"engine_build": 3}, Backend.TENSORRTLLM),
        ("llm", {"llm_api": True}, Backend.LLM_API),
        ("llm", {}, Backend.TRANSFORMERS),
        ("embedding", {}, Backend.PYTHON),
        ("reranker", {"engine_build": 3}, Backend.PYTHON),  # whose rules then refuse the engine by name
        ("python", {}, None),
    ],
)
def test_a_placement_goes_to_the_backend_it_asks_for(kind, asked, backend):  # noqa: ANN001
    chosen = backend_for(PlacementSpec(model="m", **asked), RegisteredModel(name="m", kind=kind))
    assert (chosen.key if chosen else None) == backend


def _two_gpus(operator):  # noqa: ANN001, ANN202
    factories.gpu_host("gpu-1", count=2)
    factories.surveyed()
    return deployments.deployment_create(
        name="emb",
        hosts=["gpu-1"],
        placements=[PlacementSpec(model="minilm", instance_count=2, gpu_memory_fraction=0.2)],
        user=operator,
    )


def test_a_replica_is_sent_with_its_plan_and_its_host_runs_by_it(minilm, operator):
    deployment = _two_gpus(operator)
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    replica = Replica.objects.get(deployment=deployment)
    assert replica.status == S.LAUNCHING
    # "auto" resolved on the replica's host: a GPU, the host's first.
    assert replica.plan == {
        "generation": 1,
        "gpus": [0],
        "models": [
            {"triton_name": "minilm", "backend": "python", "instance_kind": "KIND_GPU", "instance_count": 2,
             "gpus": [0], "kv_cache_tokens": None, "kv_cache_share": None, "max_seq_len": None,
             "max_num_sequences": None},
        ],
    }  # fmt: skip
    # The host builds its model specs and server from the stored plan, not from its own reading of the rows.
    moved = {**replica.plan, "gpus": [1], "models": [{**replica.plan["models"][0], "gpus": [1]}]}
    Replica.objects.filter(pk=replica.pk).update(plan=moved)
    [spec] = plan.model_specs(plan.load(replica.pk))
    assert spec.instances == Instances(count=2, kind="KIND_GPU", gpus=(1,))
    assert plan.launch_spec(plan.load(replica.pk)).gpu_ids == (1,)


def test_each_generation_sent_or_rolled_back_to_is_planned_again(minilm, operator):
    deployment = _two_gpus(operator)
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    replica = Replica.objects.get(deployment=deployment)
    states.replica_transition(replica_id=replica.pk, to=S.LOADING, source="t", runtime_handle="1")
    states.replica_transition(replica_id=replica.pk, to=S.READY, source="t", generation=1)
    deployments.deployment_change(
        deployment_id=deployment.pk,
        placements=[PlacementSpec(model="minilm", instance_kind="KIND_GPU", gpu_ids=(1,), gpu_memory_fraction=0.2)],
        user=operator,
    )
    replica.refresh_from_db()
    assert replica.status == S.UPDATING  # the roll sent it generation 2, planned
    assert replica.plan["generation"] == 2 and replica.plan["models"][0]["gpus"] == [1]
    assert replica.plan["models"][0]["instance_count"] == 1
    generations.deployment_rollback(deployment_id=deployment.pk, failed_generation=2, reason="did not load", source="t")
    replica.refresh_from_db()
    assert replica.plan["generation"] == 1 and replica.plan["models"][0]["gpus"] == [0]
    assert replica.plan["models"][0]["instance_count"] == 2
    replicas.replica_ready(replica_id=replica.pk, source="t", message="ok", from_status=S.UPDATING, generation=1)


def test_a_replica_placed_before_plans_were_stored_is_planned_on_its_host(minilm, operator):
    deployment = _two_gpus(operator)
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    replica = Replica.objects.get(deployment=deployment)
    Replica.objects.filter(pk=replica.pk).update(plan={})
    [spec] = plan.model_specs(plan.load(replica.pk))
    assert spec.instances == Instances(count=2, kind="KIND_GPU", gpus=(0,))
