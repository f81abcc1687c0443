"""Autoscaling: HPA's rule with a cooldown and a bound on each step, every
change on the timeline, settings checked by field."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from core.models import Event
from deployments import states
from deployments.models import Deployment, Replica
from deployments.models import DeploymentStatus as S
from deployments.services import autoscale, deployments, telemetry
from deployments.services.autoscale import AutoscaleSpec, autoscale_decide
from deployments.services.placements import PlacementSpec
from hosts.models import GpuHost
from tests import factories

SPEC = AutoscaleSpec(min_replicas=2, max_replicas=8, target=4.0)


@pytest.mark.parametrize(
    ("current", "values", "wanted"),
    [
        (2, [4.2, 3.9], 2),  # within 10 % of the target: left alone
        (2, [8.0, 8.0], 4),  # twice the target on each: twice the replicas
        (2, [20.0, 20.0], 4),  # asks for 10, grows at most twofold
        (4, [0.0, 0.0, 0.0, 0.0], 3),  # idle: shrinks by one at a time
        (3, [0.0, 0.0, 0.0], 2),
        (2, [0.0, 0.0], 2),  # never below min
        (6, [40.0] * 6, 8),  # never above max
        (3, [8.0, 8.0], 4),  # the ready ones count: a third still starting is not idle
    ],
)
def test_the_count_follows_the_load_within_its_bounds(current, values, wanted):
    assert autoscale_decide(current=current, values=values, spec=SPEC).replicas == wanted


def test_a_replica_still_starting_is_neither_shrunk_away_nor_doubled_before_its_load_is_known():
    spec = AutoscaleSpec(min_replicas=1, max_replicas=4, target=6.0)
    # Two wanted, one ready and at its target: the second is starting, not surplus.
    assert autoscale_decide(current=2, values=[6.0], spec=spec).replicas == 2
    # One ready, lightly loaded: the one starting counts at the target, so no step down yet.
    assert autoscale_decide(current=2, values=[2.0], spec=spec).replicas == 2
    # One ready holding twice the target: the one starting counts at 0, and together they hold it.
    assert autoscale_decide(current=2, values=[12.0], spec=spec).replicas == 2
    # Far above even with the one starting: up, said with what was counted.
    decision = autoscale_decide(current=2, values=[30.0], spec=spec)
    assert decision.replicas == 4 and "1 replica(s) starting, counted at 0" in decision.reason


def test_queue_time_is_held_at_its_target_per_replica():
    spec = AutoscaleSpec(min_replicas=1, max_replicas=4, metric="queue_ms", target=50.0)
    decision = autoscale_decide(current=1, values=[120.0], spec=spec)
    assert decision.replicas == 2
    assert decision.reason.startswith("120.00 ms queue time per ready replica (1) against a target of 50")
    assert "the metric asks for 3; a step grows at most twofold" in decision.reason


@pytest.fixture
def web(db, minilm, operator):  # noqa: ANN001, ANN201 - a ready deployment of one replica; room for one a host
    for i in (1, 2, 3):
        factories.gpu_host(f"gpu-{i}", count=1)
    factories.surveyed()
    deployment = deployments.deployment_create(
        name="web",
        hosts=[],
        placements=[PlacementSpec(model="minilm", instance_kind="KIND_GPU", gpu_ids=(0,), gpu_memory_fraction=0.6)],
        autoscale=AutoscaleSpec(min_replicas=1, max_replicas=3, target=2.0, cooldown_s=60),
        user=operator,
    )
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    _all_ready(deployment)
    return deployment


def _all_ready(deployment: Deployment) -> None:
    for replica in Replica.objects.filter(deployment=deployment).exclude(status=S.READY):
        states.replica_transition(replica_id=replica.pk, to=S.LOADING, source="t", runtime_handle="1")
        states.replica_transition(replica_id=replica.pk, to=S.READY, source="t", generation=1)


def _load(deployment: Deployment, in_flight: float) -> None:
    Replica.objects.filter(deployment=deployment).update(in_flight=in_flight)


def test_load_scales_out_after_the_cooldown_and_each_decision_says_why(web):
    _load(web, 6.0)
    [(deployment_id, decision)] = autoscale.deployments_autoscale()
    assert deployment_id == web.pk and decision.replicas == 2
    assert Replica.objects.filter(deployment=web, desired_state="running").count() == 2
    event = Event.objects.get(deployment=web, kind="deployment.autoscaled")
    assert event.message.startswith("replicas 1 → 2: 6.00 requests in flight per ready replica (1)")
    # Within the cooldown nothing moves, however loaded.
    _all_ready(web)
    _load(web, 9.0)
    assert autoscale.deployments_autoscale() == []
    later = timezone.now() + timedelta(seconds=61)
    [(_, decision)] = autoscale.deployments_autoscale(now=later)
    assert decision.replicas == 3  # asks for 9, held at max 3
    assert "held within 1..3" in decision.reason
    _all_ready(web)
    _load(web, 0.0)
    Deployment.objects.filter(pk=web.pk).update(scaled_at=timezone.now() - timedelta(seconds=61))
    # Idle: a step down waits until the decisions have asked for fewer for a whole cooldown...
    assert autoscale.deployments_autoscale() == []
    _load(web, 2.0)  # ...and a decision that does not starts the wait again
    assert autoscale.deployments_autoscale() == []
    assert Deployment.objects.get(pk=web.pk).autoscale_low_since is None
    _load(web, 0.0)
    assert autoscale.deployments_autoscale() == []
    [(_, decision)] = autoscale.deployments_autoscale(now=timezone.now() + timedelta(seconds=61))
    assert decision.replicas == 2  # idle: one fewer per step
    assert Replica.objects.filter(deployment=web, desired_state="running").count() == 2


def test_streams_a_generating_model_holds_count_as_load(web):
    """A decoupled model's request leaves Triton's own figures once execute()
    returns; the streams it still generates (held, from the server's metrics)
    are the load the autoscaler holds at its target."""
    [replica] = Replica.objects.filter(deployment=web)
    models = {"minilm": {"pending": 0.0, "concurrency": 0.02}}
    telemetry.metrics_record(deployment_id=web.pk, replica_id=replica.pk, models=models, gpus={}, held=6)
    assert Replica.objects.get(pk=replica.pk).in_flight == 6.0
    [(_, decision)] = autoscale.deployments_autoscale()
    assert decision.replicas == 2
    telemetry.metrics_record(deployment_id=web.pk, replica_id=replica.pk, models=models, gpus={}, held=0)
    assert Replica.objects.get(pk=replica.pk).in_flight == 0.02  # Triton's own mean, when more


def test_a_scale_out_that_fits_nowhere_is_said_once_per_cooldown(web):
    # The other hosts stop beating: the one left has no room for a second replica.
    GpuHost.objects.exclude(replicas__deployment=web).update(last_heartbeat=None)
    _load(web, 6.0)
    autoscale.deployments_autoscale()
    assert Deployment.objects.get(pk=web.pk).replicas == 1
    held = Event.objects.get(deployment=web, kind="deployment.autoscale_held")
    assert "wanted 2 replicas" in held.message and "fits on no host" in held.message
    assert autoscale.deployments_autoscale() == []  # not again before the cooldown


def test_settings_are_checked_by_field_and_a_person_scales_within_them(api, web):
    refused = api.post(f"/api/deployments/{web.pk}/autoscale/", {"min_replicas": 4, "max_replicas": 2}, format="json")
    assert refused.status_code == 400 and "min_replicas" in refused.data["errors"]
    refused = api.post(f"/api/deployments/{web.pk}/autoscale/", {"target": 0}, format="json")
    assert refused.status_code == 400 and "target" in refused.data["errors"]
    # Raising the floor above the count moves the count inside the bounds now.
    answer = api.post(f"/api/deployments/{web.pk}/autoscale/", {"min_replicas": 2, "max_replicas": 3}, format="json")
    assert answer.status_code == 202, answer.data
    assert answer.data["replicas"] == 2 and answer.data["autoscale"]["on"] is True
    refused = api.post(f"/api/deployments/{web.pk}/scale/", {"replicas": 5}, format="json")
    assert refused.status_code == 400 and "outside autoscaling's bounds 2..3" in str(refused.data["errors"]["replicas"])
    answer = api.post(f"/api/deployments/{web.pk}/autoscale/", {"max_replicas": None}, format="json")
    assert answer.data["autoscale"]["on"] is False
    assert Event.objects.filter(deployment=web, kind="deployment.autoscale_set").count() == 2


def test_a_new_deployment_hears_of_its_autoscaling_fields_by_name(api, minilm):
    body = {"name": "bad", "replicas": 5, "autoscale": {"max_replicas": 3},
            "models": [{"model": "minilm"}]}  # fmt: skip
    refused = api.post("/api/deployments/", body, format="json")
    assert refused.status_code == 400
    assert refused.data["errors"]["replicas"] == ["5 is outside autoscaling's bounds 1..3"]
    body = {**body, "replicas": 1, "autoscale": {"min_replicas": 2}}
    refused = api.post("/api/deployments/", body, format="json")
    assert "autoscale.max_replicas" in refused.data["errors"]
    assert not Deployment.objects.filter(name="bad").exists()
