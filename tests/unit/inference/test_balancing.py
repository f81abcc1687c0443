"""Balancing across replicas: the fewest in flight first (queue time breaks
ties), one retry on another replica before any answer, and ejection after
failures in a row with a return after the cool-off, each said on the timeline."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import PermanentError, TransientError
from core.models import Event
from inference import balancing
from inference.balancing import Balancer, Endpoint
from tests import factories

A = Endpoint(replica_id=1, url="a:1", label="r1 on a")
B = Endpoint(replica_id=2, url="b:1", label="r2 on b")


def test_the_replica_with_the_fewest_in_flight_is_picked_and_queue_time_breaks_ties():
    balancer = Balancer()
    balancer.begin(A)
    assert balancer.pick([A, B]) == B
    balancer.begin(B)
    slower = Endpoint(replica_id=2, url="b:1", label="r2 on b", queue_ms=40.0)
    assert balancer.pick([A, slower]) == A  # one in flight each: the shorter queue
    balancer.end(A, failed=False)
    assert balancer.pick([A, slower]) == A


def test_even_load_turns_between_replicas():
    balancer = Balancer()
    picked = [balancer.pick([A, B]) for _ in range(4)]
    assert {p.replica_id for p in picked} == {1, 2}


def test_failures_in_a_row_eject_a_replica_until_its_cool_off_ends(settings, monkeypatch):
    settings.GANTRY_EJECT_AFTER_FAILURES = 2
    settings.GANTRY_EJECT_COOLOFF_S = 30
    now = [1000.0]
    monkeypatch.setattr(balancing.time, "monotonic", lambda: now[0])
    balancer = Balancer()
    assert balancer.end(A, failed=True) == ""
    assert balancer.end(A, failed=True).startswith("ejected by a gateway process after 2 failed request(s)")
    assert all(balancer.pick([A, B]) == B for _ in range(5))  # left out while cooling off
    assert balancer.figures(1) == {"in_flight": 0, "ejections": 1, "ejected": True}
    assert balancer.pick([A]) == A  # the only one left is still tried
    now[0] += 31
    picked = {balancer.pick([A, B]).replica_id for _ in range(4)}
    assert 1 in picked  # back by itself
    assert balancer.end(A, failed=False) == "answered again after its cool-off: routed to again"


def test_a_request_that_fails_before_answering_is_retried_once_on_another_replica():
    balancer_before = balancing.balancer
    balancing.balancer = Balancer()
    tried = []

    async def request(endpoint: Endpoint) -> str:
        tried.append(endpoint.replica_id)
        if endpoint.replica_id == 1:
            raise TransientError("unreachable")
        return "ok"

    try:
        balancing.balancer.begin(B)  # B busier: A is picked first, fails, B answers
        assert asyncio.run(balancing.call([A, B], request)) == "ok"
        assert tried == [1, 2]
        tried.clear()

        async def refused(endpoint: Endpoint) -> str:
            tried.append(endpoint.replica_id)
            raise PermanentError("bad input")

        with pytest.raises(PermanentError):
            asyncio.run(balancing.call([A, B], refused))
        assert len(tried) == 1  # a refusal is the model's answer: never retried

        async def down(endpoint: Endpoint) -> str:
            raise TransientError(f"{endpoint.label} down")

        with pytest.raises(TransientError):
            asyncio.run(balancing.call([A, B, Endpoint(replica_id=3, url="c:1", label="r3")], down))
    finally:
        balancing.balancer = balancer_before


def test_an_ejection_is_said_on_the_replicas_timeline(host, minilm, operator, settings):
    settings.GANTRY_EJECT_AFTER_FAILURES = 1
    deployment = factories.deployment_in(factories.deployment(host=host, user=operator), "launching")
    replica = factories.replica_of(deployment)
    endpoint = Endpoint(replica_id=replica.pk, url="x:1", label="r1 on cpu-host")
    balancing.finish(endpoint, failed=True)
    said = Event.objects.get(deployment=deployment, kind="replica.balancing")
    assert said.message.startswith("r1 on cpu-host: ejected by a gateway process") and said.data["replica"] == 1


def test_a_replica_on_a_host_that_stopped_beating_is_tried_only_when_no_other_is_left():
    balancer = Balancer()
    away = Endpoint(replica_id=3, url="c:1", label="r3 on c", stale=True)
    balancer.begin(A)
    balancer.begin(A)
    assert balancer.pick([A, away]) == A  # busier, but its host beats
    assert balancer.pick([away]) == away  # the last one left still serves (its server may live on)
