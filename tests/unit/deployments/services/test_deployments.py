"""The deployment lifecycle services: create, change (generations), roll back, start, stop."""

from __future__ import annotations

import pytest

from common.errors import InvalidTransition, ValidationFailed
from deployments.models import Deployment, DeploymentStatus, RevisionStatus
from deployments.services import deployments, generations
from deployments.services.placements import PlacementSpec
from tests import factories


def test_start_of_running_deployment_is_refused(deployment, operator):
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    with pytest.raises(InvalidTransition, match="launching"):
        deployments.deployment_start(deployment_id=deployment.pk, user=operator)


def test_stop_of_stopped_deployment_is_refused(deployment, operator):
    with pytest.raises(InvalidTransition, match="nothing to stop"):
        deployments.deployment_stop(deployment_id=deployment.pk, user=operator)


@pytest.fixture
def deployment(host, minilm, operator):
    factories.surveyed()
    return deployments.deployment_create(
        name="d", hosts=[host.name], placements=[PlacementSpec(model="minilm")], user=operator
    )


def _change(deployment, operator, **overrides):
    return deployments.deployment_change(
        deployment_id=deployment.pk, placements=[PlacementSpec(model="minilm", **overrides)], user=operator
    )


def test_changing_a_stopped_deployment_makes_a_new_generation(deployment, operator):
    changed = _change(deployment, operator, max_batch_size=8)
    assert changed.generation == 2 and changed.status == DeploymentStatus.PENDING
    assert changed.placements.get().max_batch_size == 8
    statuses = list(changed.revisions.order_by("generation").values_list("generation", "status"))
    assert statuses == [(1, RevisionStatus.SUPERSEDED), (2, RevisionStatus.CURRENT)]


def test_a_change_to_the_same_placements_is_refused_and_stores_nothing(deployment, operator):
    with pytest.raises(ValidationFailed, match="nothing to change"):
        _change(deployment, operator)
    assert Deployment.objects.get(pk=deployment.pk).generation == 1
    assert deployment.revisions.count() == 1


def test_a_change_while_launching_is_refused(deployment, operator):
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    with pytest.raises(InvalidTransition, match="launching"):
        _change(deployment, operator, max_batch_size=8)


def test_a_ready_deployment_loads_its_new_generation(deployment, operator):
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    factories.deployment_in(deployment, "loading", "ready")
    changed = _change(deployment, operator, max_batch_size=8)
    assert (changed.status, changed.status_message) == (DeploymentStatus.UPDATING, "generation 1 → 2")
    replica = factories.replica_of(deployment)
    assert (replica.status, replica.generation) == ("updating", 1)


def test_rollback_restores_the_previous_placements(deployment, operator):
    _change(deployment, operator, max_batch_size=8)
    restored = generations.deployment_rollback(
        deployment_id=deployment.pk, failed_generation=2, reason="did not load", source="t"
    )
    assert restored.generation == 1
    assert restored.placements.get().max_batch_size == 32
    failed = restored.revisions.get(generation=2)
    assert (failed.status, failed.message) == (RevisionStatus.FAILED, "did not load")
    assert restored.revisions.get(generation=1).status == RevisionStatus.CURRENT
    # The failed generation keeps its number: the next change is generation 3.
    again = _change(deployment, operator, max_batch_size=4)
    statuses = list(again.revisions.order_by("generation").values_list("generation", "status"))
    assert again.generation == 3
    assert statuses == [(1, RevisionStatus.SUPERSEDED), (2, RevisionStatus.FAILED), (3, RevisionStatus.CURRENT)]
