import pytest

from deployments import services, states
from deployments.errors import InvalidTransition
from deployments.models import Deployment, Event
from deployments.models import DeploymentStatus as S


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


def test_ready_is_reached_by_loading_updating_or_recovering():
    assert states.sources_of(S.READY) == {S.LOADING, S.UPDATING, S.DEGRADED}


@pytest.fixture
def deployment(host, minilm, operator):
    return services.deployment_create(
        name="demo", host_name=host.name, placements=[services.PlacementSpec(model="minilm")], user=operator
    )


def test_transition_records_an_event_with_both_states(deployment):
    services.deployment_transition(deployment_id=deployment.pk, to=S.LAUNCHING, source="test")
    event = Event.objects.filter(deployment=deployment, kind="deployment.status").get()
    assert (event.from_status, event.to_status, event.source) == (S.PENDING, S.LAUNCHING, "test")


def test_disallowed_transition_changes_nothing(deployment):
    before = Event.objects.count()
    with pytest.raises(InvalidTransition, match="cannot go from pending to ready"):
        services.deployment_transition(deployment_id=deployment.pk, to=S.READY, source="test")
    deployment.refresh_from_db()
    assert deployment.status == S.PENDING
    assert Event.objects.count() == before


def test_only_from_narrows_the_table(deployment):
    services.deployment_transition(deployment_id=deployment.pk, to=S.LAUNCHING, source="test")
    with pytest.raises(InvalidTransition):
        services.deployment_transition(
            deployment_id=deployment.pk, to=S.FAILED, source="test", only_from=frozenset({S.LOADING})
        )
    assert Deployment.objects.get(pk=deployment.pk).status == S.LAUNCHING


def test_start_of_running_deployment_is_refused(deployment, operator):
    services.deployment_start(deployment_id=deployment.pk, user=operator)
    with pytest.raises(InvalidTransition, match="launching"):
        services.deployment_start(deployment_id=deployment.pk, user=operator)


def test_stop_of_stopped_deployment_is_refused(deployment, operator):
    with pytest.raises(InvalidTransition, match="nothing to stop"):
        services.deployment_stop(deployment_id=deployment.pk, user=operator)


def test_events_are_append_only(deployment):
    event = Event.objects.first()
    event.message = "rewritten"
    with pytest.raises(TypeError):
        event.save()
    with pytest.raises(TypeError):
        Event.objects.filter(pk=event.pk).update(message="rewritten")
