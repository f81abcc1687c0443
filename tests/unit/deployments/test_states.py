"""The state machines: every table is complete, and a transition is a compare-and-swap with an event."""

from __future__ import annotations

import pytest

from common.errors import InvalidTransition
from core.models import Event
from deployments import states
from deployments.models import Deployment
from deployments.models import DeploymentStatus as S
from deployments.services import deployments
from deployments.services.placements import PlacementSpec
from tests import factories


def test_every_status_has_a_row_in_the_transition_table():
    assert set(states.ALLOWED) == set(S.values)
    for targets in states.ALLOWED.values():
        assert targets <= set(S.values)


@pytest.mark.parametrize(
    ("current", "target", "allowed"),
    [
        (S.PENDING, S.LAUNCHING, True),
        (S.LAUNCHING, S.LOADING, True),
        (S.LOADING, S.READY, True),
        (S.READY, S.STOPPING, True),
        (S.STOPPING, S.STOPPED, True),
        (S.STOPPED, S.LAUNCHING, True),
        (S.FAILED, S.LAUNCHING, True),
        (S.READY, S.LAUNCHING, False),
        (S.PENDING, S.READY, False),
        (S.STOPPED, S.STOPPING, False),
        (S.STOPPED, S.READY, False),
        (S.LAUNCHING, S.READY, False),
    ],
)
def test_transition_table(current, target, allowed):
    assert states.is_allowed(current, target) is allowed


def test_ready_is_reached_by_loading_updating_recovering_or_a_host_come_back():
    assert states.sources_of(S.READY) == {S.LOADING, S.UPDATING, S.DEGRADED, S.LOST}


@pytest.fixture
def deployment(host, minilm, operator):
    factories.surveyed()
    return deployments.deployment_create(
        name="demo", hosts=[host.name], placements=[PlacementSpec(model="minilm")], user=operator
    )


def test_a_replicas_move_records_its_event_and_sums_its_deployment_up(deployment):
    factories.deployment_in(deployment, "launching")
    replica = factories.replica_of(deployment)
    moved = Event.objects.filter(deployment=deployment, kind="replica.status").get()
    assert (moved.from_status, moved.to_status, moved.data["replica"]) == (S.PENDING, S.LAUNCHING, replica.serial)
    summed = Event.objects.filter(deployment=deployment, kind="deployment.status").get()
    assert (summed.from_status, summed.to_status, summed.source) == (S.PENDING, S.LAUNCHING, "test")


def test_disallowed_transition_changes_nothing(deployment):
    factories.deployment_in(deployment, "launching")
    replica = factories.replica_of(deployment)
    before = Event.objects.count()
    with pytest.raises(InvalidTransition, match="cannot go from launching to ready"):
        states.replica_transition(replica_id=replica.pk, to=S.READY, source="test")
    assert factories.replica_of(deployment).status == S.LAUNCHING
    assert Deployment.objects.get(pk=deployment.pk).status == S.LAUNCHING
    assert Event.objects.count() == before


def test_only_from_narrows_the_table(deployment):
    factories.deployment_in(deployment, "launching")
    replica = factories.replica_of(deployment)
    with pytest.raises(InvalidTransition):
        states.replica_transition(replica_id=replica.pk, to=S.FAILED, source="test", only_from=frozenset({S.LOADING}))
    assert Deployment.objects.get(pk=deployment.pk).status == S.LAUNCHING


@pytest.mark.parametrize(
    ("statuses", "wanted", "desired", "summed"),
    [
        ([S.READY, S.READY, S.READY], 3, "running", S.READY),
        ([S.READY, S.READY, S.LAUNCHING], 3, "running", S.DEGRADED),
        ([S.READY, S.LOST], 2, "running", S.DEGRADED),
        ([S.READY, S.UPDATING], 2, "running", S.UPDATING),
        ([S.LOADING, S.LAUNCHING], 2, "running", S.LOADING),
        ([S.FAILED, S.LOST], 2, "running", S.FAILED),
        ([S.STOPPING, S.STOPPED], 2, "stopped", S.STOPPING),
        ([S.STOPPED, S.STOPPED], 2, "stopped", S.STOPPED),
        ([S.STOPPED, S.FAILED], 2, "stopped", S.FAILED),
        ([], 2, "stopped", S.PENDING),
    ],
)
def test_a_deployments_status_sums_up_its_replicas(statuses, wanted, desired, summed):
    assert states.deployment_status_of(statuses, wanted=wanted, desired=desired, current=S.PENDING) == summed


def test_events_are_append_only(deployment):
    event = Event.objects.first()
    event.message = "rewritten"
    with pytest.raises(TypeError):
        event.save()
    with pytest.raises(TypeError):
        Event.objects.filter(pk=event.pk).update(message="rewritten")


@pytest.mark.parametrize(
    ("status", "actions"),
    [
        (
            S.PENDING,
            {
                "start": True,
                "stop": False,
                "restart": False,
                "change": True,
                "rollback": True,
                "delete": True,
                "scale": True,
            },
        ),
        (
            S.LAUNCHING,
            {
                "start": False,
                "stop": True,
                "restart": False,
                "change": False,
                "rollback": False,
                "delete": False,
                "scale": True,
            },
        ),
        (
            S.READY,
            {
                "start": False,
                "stop": True,
                "restart": True,
                "change": True,
                "rollback": True,
                "delete": False,
                "scale": True,
            },
        ),
        (
            S.STOPPING,
            {
                "start": False,
                "stop": False,
                "restart": False,
                "change": False,
                "rollback": False,
                "delete": False,
                "scale": False,
            },
        ),
        (
            S.FAILED,
            {
                "start": True,
                "stop": True,
                "restart": True,
                "change": True,
                "rollback": True,
                "delete": True,
                "scale": True,
            },
        ),
    ],
)
def test_the_actions_a_status_allows_come_from_the_table(status, actions):
    assert states.deployment_actions(status) == actions


def test_a_second_inspection_of_the_same_model_changes_nothing(minilm):
    assert not states.inspection_transition(model_id=minilm.pk, to="failed", message="late duplicate")
    minilm.refresh_from_db()
    assert (minilm.inspection, minilm.inspection_message) == ("ready", "")


def test_a_failed_revision_cannot_become_current_again(host, minilm, operator):
    deployment = factories.deployment(host=host, user=operator)
    states.revision_transition(deployment_id=deployment.pk, generation=1, to="failed", message="did not load")
    with pytest.raises(InvalidTransition, match="revision 1 of deployment .* cannot become current"):
        states.revision_transition(deployment_id=deployment.pk, generation=1, to="current")
