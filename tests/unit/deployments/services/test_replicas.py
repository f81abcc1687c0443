"""Replicas: placement across the hosts' GPU plans, scaling, lost hosts (and a
flapping one), and a new generation rolled one replica at a time."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from common.errors import InvalidTransition
from core.models import Event
from deployments import selectors, states
from deployments.models import Deployment, Replica
from deployments.models import DeploymentStatus as S
from deployments.services import deployments, replicas
from deployments.services.placements import PlacementSpec
from hosts.models import GpuHost
from tests import factories


def _create(operator, name: str, fraction: float, count: int, *, hosts=(), policy: str = "spread", gpus=(0,),  # noqa: ANN001, ANN202
            physical: bool = False):  # fmt: skip
    factories.surveyed()
    return deployments.deployment_create(
        name=name,
        hosts=list(hosts),
        replicas=count,
        placement_policy=policy,
        physical_gpus=physical,
        placements=[
            PlacementSpec(model="minilm", instance_kind="KIND_GPU", gpu_ids=gpus, gpu_memory_fraction=fraction)
        ],
        user=operator,
    )


def _where(deployment: Deployment) -> list[tuple[str, dict[int, int]]]:
    return [(r.host.name, r.gpus) for r in Replica.objects.filter(deployment=deployment).order_by("serial")]


@pytest.fixture
def fleet(db, minilm):  # noqa: ANN001, ANN201 - three hosts of two GPUs each, beside the model's CPU host
    return [factories.gpu_host(f"gpu-{i}", count=2) for i in (1, 2, 3)]


def test_spread_puts_each_replica_on_another_host_and_pack_fills_one_first(fleet, operator):
    spread = _create(operator, "spread", 0.3, 3)
    deployments.deployment_start(deployment_id=spread.pk, user=operator)
    assert sorted(host for host, _ in _where(spread)) == ["gpu-1", "gpu-2", "gpu-3"]
    packed = _create(operator, "packed", 0.3, 3, policy="pack")
    deployments.deployment_start(deployment_id=packed.pk, user=operator)
    where = _where(packed)
    # Packed onto one host, the fullest GPU that still fits first: GPU 0 takes two 0.3
    # shares beside spread's one (0.9 of 0.95), and GPU 1 the third.
    assert len({host for host, _ in where}) == 1
    assert sorted(gpu for _, gpus in where for gpu in gpus.values()) == [0, 0, 1]


def test_a_replica_that_fits_nowhere_is_refused_with_the_closest_hosts_shortfall(fleet, operator):
    big = _create(operator, "big", 0.9, 3, gpus=(0, 1))
    deployments.deployment_start(deployment_id=big.pk, user=operator)
    more = _create(operator, "more", 0.5, 1)
    with pytest.raises(InvalidTransition) as refused:
        deployments.deployment_start(deployment_id=more.pk, user=operator)
    assert str(refused.value).startswith(
        "more's replica 1 of 1 fits on no host (any online host): gpu-1 is short by 0.45"
    )
    assert "together with big r1 (launching)" in str(refused.value)
    assert not Replica.objects.filter(deployment=more).exists()  # nothing written
    assert Deployment.objects.get(pk=more.pk).desired_state == "stopped"


def test_the_preflight_says_where_each_replica_would_go(api, fleet, operator):
    factories.surveyed()
    body = {"name": "", "replicas": 2, "models": [{"model": "minilm", "gpu_ids": [0], "gpu_memory_fraction": 0.5,
                                                    "instance_kind": "KIND_GPU"}]}  # fmt: skip
    answer = api.post("/api/deployments/preflight/", body, format="json").data
    assert answer["valid"], answer
    assert [(r["host"], r["gpus"]) for r in answer["replicas"]] == [("gpu-1", {"0": 0}), ("gpu-2", {"0": 0})]


def test_physical_gpu_ids_name_the_hosts_own_gpus_and_are_never_moved(fleet, operator):
    # GPU 1 of gpu-1 is nearly full; GPU 0 of every host is free.
    factories.deployment_in(_create(operator, "big", 0.8, 1, hosts=["gpu-1"], gpus=(1,), physical=True), "launching")
    assert _where(Deployment.objects.get(name="big")) == [("gpu-1", {1: 1})]
    # Its own numbers: GPU 1 stays GPU 1, and a host whose GPU 1 lacks room takes no replica...
    pinned = _create(operator, "pinned", 0.5, 1, hosts=["gpu-1"], gpus=(1,), physical=True)
    with pytest.raises(InvalidTransition) as refused:
        deployments.deployment_start(deployment_id=pinned.pk, user=operator)
    assert "gpu-1's GPU(s) 1 (physical)" in str(refused.value), refused.value
    # ...while without physical ids the same request maps GPU 1 onto the free GPU 0.
    moved = _create(operator, "moved", 0.5, 1, hosts=["gpu-1"], gpus=(1,))
    deployments.deployment_start(deployment_id=moved.pk, user=operator)
    assert _where(moved) == [("gpu-1", {1: 0})]
    # Spread, physical: the other hosts' own GPU 1.
    spread = _create(operator, "spread", 0.5, 2, gpus=(1,), physical=True)
    deployments.deployment_start(deployment_id=spread.pk, user=operator)
    assert sorted(_where(spread)) == [("gpu-2", {1: 1}), ("gpu-3", {1: 1})]


def test_scaling_places_more_and_retires_the_least_useful(fleet, operator):
    deployment = _create(operator, "web", 0.2, 2)
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    first, second = Replica.objects.filter(deployment=deployment).order_by("serial")
    for replica in (first, second):
        states.replica_transition(replica_id=replica.pk, to=S.LOADING, source="t", runtime_handle="1")
    states.replica_transition(replica_id=first.pk, to=S.READY, source="t", generation=1)
    deployments.deployment_scale(deployment_id=deployment.pk, replicas=3, user=operator)
    assert Replica.objects.filter(deployment=deployment).count() == 3
    assert Deployment.objects.get(pk=deployment.pk).status == S.DEGRADED  # 1 of 3 ready
    deployments.deployment_scale(deployment_id=deployment.pk, replicas=1, user=operator)
    # The two not ready are retired; the ready one stays.
    kept = Replica.objects.filter(deployment=deployment, desired_state="running")
    assert list(kept.values_list("serial", flat=True)) == [first.serial]
    assert Event.objects.filter(deployment=deployment, kind="deployment.scaled").count() == 2


def _ready(deployment: Deployment) -> list[Replica]:
    rows = list(Replica.objects.filter(deployment=deployment).order_by("serial"))
    for replica in rows:
        if replica.status == S.LAUNCHING:
            states.replica_transition(replica_id=replica.pk, to=S.LOADING, source="t", runtime_handle="1")
        states.replica_transition(replica_id=replica.pk, to=S.READY, source="t", generation=1)
    return rows


def test_a_lost_host_is_replaced_after_the_grace_and_its_return_stops_the_surplus(
    fleet, operator, settings, django_assert_max_num_queries
):
    settings.GANTRY_HOST_LOST_GRACE_S = 60
    deployment = _create(operator, "svc", 0.3, 2)
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    first, second = _ready(deployment)
    gone = GpuHost.objects.filter(pk=second.host_id)
    # Missing its beats, but within the grace: nothing is replaced (a flap).
    gone.update(last_heartbeat=timezone.now() - timedelta(seconds=30))
    assert replicas.replace_lost(source="system") == []
    assert Replica.objects.filter(deployment=deployment).count() == 2
    # Past the grace: lost, and a replacement starts on the host that has none.
    gone.update(last_heartbeat=timezone.now() - timedelta(seconds=90))
    [lost] = replicas.replace_lost(source="system")
    assert lost.pk == second.pk and Replica.objects.get(pk=second.pk).status == S.LOST
    replacement = Replica.objects.filter(deployment=deployment).exclude(pk__in=[first.pk, second.pk]).get()
    assert replacement.status == S.LAUNCHING and replacement.host.name not in (first.host.name, second.host.name)
    assert Deployment.objects.get(pk=deployment.pk).status == S.DEGRADED
    _ready_one(replacement)
    # Replaced: later sweeps find nothing short, and leave the deployment alone.
    with django_assert_max_num_queries(3):
        assert replicas.replace_lost(source="system") == []
    # The host comes back with its server still up: three serve two wanted; the lost one was
    # the oldest generation... all are generation 1, so the newest replica goes.
    gone.update(last_heartbeat=timezone.now())
    states.replica_transition(replica_id=second.pk, to=S.READY, source="t", only_from=frozenset({S.LOST}))
    replicas.deployment_converge(deployment_id=deployment.pk, source="t")
    retired = Replica.objects.filter(deployment=deployment, desired_state="stopped").get()
    assert retired.pk == replacement.pk and retired.status == S.STOPPING
    assert Deployment.objects.get(pk=deployment.pk).status == S.READY


def _ready_one(replica: Replica) -> None:
    states.replica_transition(replica_id=replica.pk, to=S.LOADING, source="t", runtime_handle="1")
    states.replica_transition(replica_id=replica.pk, to=S.READY, source="t", generation=1)


def test_a_surplus_on_an_older_generation_goes_first(fleet, operator):
    deployment = _create(operator, "gen", 0.2, 2)
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    first, second = _ready(deployment)
    Replica.objects.filter(pk=second.pk).update(generation=0)
    deployments.deployment_scale(deployment_id=deployment.pk, replicas=1, user=operator)
    assert Replica.objects.get(pk=second.pk).desired_state == "stopped"
    assert Replica.objects.get(pk=first.pk).desired_state == "running"


def test_a_new_generation_rolls_one_replica_at_a_time(fleet, operator):
    deployment = _create(operator, "roll", 0.2, 3)
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    rows = _ready(deployment)
    deployments.deployment_change(
        deployment_id=deployment.pk,
        placements=[PlacementSpec(model="minilm", instance_kind="KIND_GPU", gpu_ids=(0,), gpu_memory_fraction=0.2,
                                  max_batch_size=8)],
        user=operator,
    )  # fmt: skip
    for step, replica in enumerate(rows):
        statuses = dict(Replica.objects.filter(deployment=deployment).values_list("serial", "status"))
        assert statuses[replica.serial] == S.UPDATING
        assert sum(1 for s in statuses.values() if s == S.READY) == len(rows) - 1  # N-1 keep serving
        replicas.replica_ready(replica_id=replica.pk, source="t", message="ok", from_status=S.UPDATING, generation=2)
        assert Replica.objects.get(pk=replica.pk).generation == 2, step
    assert set(Replica.objects.filter(deployment=deployment).values_list("status", "generation")) == {(S.READY, 2)}
    assert Deployment.objects.get(pk=deployment.pk).status == S.READY


def test_a_host_back_whose_server_died_with_it_has_its_lost_replica_removed(fleet, operator, settings):
    from workers.deploy import reconcile

    settings.GANTRY_HOST_LOST_GRACE_S = 60
    deployment = _create(operator, "back", 0.3, 2)
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    _first, second = _ready(deployment)
    Replica.objects.filter(pk=second.pk).update(runtime_handle="999999")  # a server that is gone
    gone = GpuHost.objects.filter(pk=second.host_id)
    gone.update(last_heartbeat=timezone.now() - timedelta(seconds=90))
    replicas.replace_lost(source="system")
    replacement = Replica.objects.filter(deployment=deployment).order_by("-serial").first()
    _ready_one(replacement)
    gone.update(last_heartbeat=timezone.now())
    settings.GANTRY_HOST_NAME = second.host.name
    reconcile.recover_lost()
    assert not Replica.objects.filter(pk=second.pk).exists()
    assert Replica.objects.filter(deployment=deployment).count() == 2
    assert Event.objects.filter(deployment=deployment, kind="replica.removed").exists()


def _change_batch(deployment: Deployment, operator, fraction: float = 0.3) -> None:  # noqa: ANN001
    deployments.deployment_change(
        deployment_id=deployment.pk,
        placements=[PlacementSpec(model="minilm", instance_kind="KIND_GPU", gpu_ids=(0,), gpu_memory_fraction=fraction,
                                  max_batch_size=8)],
        user=operator,
    )  # fmt: skip


def _statuses(deployment: Deployment) -> dict[int, tuple[str, int]]:
    return {r.serial: (r.status, r.generation) for r in Replica.objects.filter(deployment=deployment)}


def _stopped(replica: Replica) -> None:
    """The host's stop task finishing: stopped, then removed (retired)."""
    states.replica_transition(replica_id=replica.pk, to=S.STOPPED, source="t", only_from=frozenset({S.STOPPING}))
    replicas.replica_start_after_stop(replica_id=replica.pk, source="t")


def test_a_change_that_needs_a_new_server_surges_where_a_gpu_has_room(fleet, operator):
    deployment = _create(operator, "surge", 0.3, 2)
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    _ready(deployment)
    _change_batch(deployment, operator)
    for step in (1, 2):
        updating = Replica.objects.get(deployment=deployment, status=S.UPDATING)
        # The host's worker finds the change needs a new server and asks for a surge.
        surge = replicas.replica_surge(replica_id=updating.pk, generation=2, why="new GPUs", source="t")
        assert surge is not None and surge.status == S.LAUNCHING and surge.generation == 2
        statuses = _statuses(deployment)
        assert statuses[updating.serial] == (S.READY, 1), step  # still serving its generation
        assert sum(1 for s, _ in statuses.values() if s == S.READY) == 2  # N keep serving
        # One surge at a time: asked again meanwhile, the replica is restarted in place instead.
        states.replica_transition(replica_id=updating.pk, to=S.UPDATING, source="t")
        assert replicas.replica_surge(replica_id=updating.pk, generation=2, why="again", source="t") is None
        states.replica_transition(replica_id=updating.pk, to=S.READY, source="t")
        states.replica_transition(replica_id=surge.pk, to=S.LOADING, source="t", runtime_handle="1")
        replicas.replica_ready(replica_id=surge.pk, source="t", message="ok", from_status=S.LOADING, generation=2)
        [retired] = Replica.objects.filter(deployment=deployment, desired_state="stopped")
        assert retired.generation == 1 and retired.status == S.STOPPING
        assert Replica.objects.filter(deployment=deployment, status=S.READY).count() == 2  # N-1 and the surge
        _stopped(retired)
    assert sorted(_statuses(deployment).values()) == [(S.READY, 2), (S.READY, 2)]
    assert len({r.host_id for r in Replica.objects.filter(deployment=deployment)}) == 2  # still spread
    assert Deployment.objects.get(pk=deployment.pk).status == S.READY


def test_without_room_for_a_surge_the_replica_restarts_in_place(db, minilm, operator):
    host = factories.gpu_host("tight", count=1)
    deployment = _create(operator, "tight", 0.6, 1, hosts=[host.name])
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    _ready(deployment)
    _change_batch(deployment, operator, fraction=0.6)
    updating = Replica.objects.get(deployment=deployment)
    assert replicas.replica_surge(replica_id=updating.pk, generation=2, why="new GPUs", source="t") is None
    assert Replica.objects.get(pk=updating.pk).status == S.UPDATING  # the worker restarts it in place
    note = Event.objects.get(deployment=deployment, kind="replica.roll")
    assert "no room for a surge replica" in note.message and "tight is short by" in note.message


def test_a_surge_replica_that_fails_to_load_rolls_the_generation_back(fleet, operator):
    deployment = _create(operator, "bad", 0.3, 2)
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    _ready(deployment)
    _change_batch(deployment, operator)
    updating = Replica.objects.get(deployment=deployment, status=S.UPDATING)
    surge = replicas.replica_surge(replica_id=updating.pk, generation=2, why="new GPUs", source="t")
    states.replica_transition(replica_id=surge.pk, to=S.LOADING, source="t", runtime_handle="1")
    assert replicas.replica_fail(
        replica_id=surge.pk, reason="model failed to load", source="t", only_from=frozenset({S.LOADING})
    )
    assert not Replica.objects.filter(pk=surge.pk).exists()
    deployment.refresh_from_db()
    assert deployment.generation == 1 and deployment.status == S.READY
    assert deployment.revisions.get(generation=2).status == "failed"
    assert sorted(_statuses(deployment).values()) == [(S.READY, 1), (S.READY, 1)]
    assert Event.objects.filter(deployment=deployment, kind="deployment.rollback").exists()


def test_a_retired_or_stopped_replica_drains_unless_stopped_now(api, fleet, operator):
    deployment = _create(operator, "drained", 0.2, 3)
    Deployment.objects.filter(pk=deployment.pk).update(drain_timeout_s=45)
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    first, second, third = _ready(deployment)
    states.replica_transition(replica_id=third.pk, to=S.DEGRADED, source="t")
    before = timezone.now()
    deployments.deployment_scale(deployment_id=deployment.pk, replicas=2, user=operator)
    # The newest answering one is retired: out of balancing, and its host lets it answer what it holds.
    retired = Replica.objects.get(pk=third.pk)
    assert (retired.status, retired.shown_status) == (S.STOPPING, "draining")
    assert before + timedelta(seconds=45) <= retired.drain_until <= timezone.now() + timedelta(seconds=45)
    assert "draining the requests it holds for up to 45s" in retired.status_message

    # A stop drains every answering replica; "now" drains none. Its body is checked by field.
    url = f"/api/deployments/{deployment.pk}/stop/"
    assert api.post(url, {"now": "yes"}, format="json").data["errors"] == {"now": ["must be a boolean"]}
    assert api.post(url, {"now": True, "later": 1}, format="json").status_code == 400
    assert Replica.objects.get(pk=first.pk).status == S.READY  # nothing half-done
    stopped = api.post(url, {"now": True}, format="json")
    assert stopped.status_code == 202, stopped.data
    rows = {r.pk: r for r in Replica.objects.filter(deployment=deployment)}
    assert rows[first.pk].status == S.STOPPING and rows[first.pk].drain_until is None
    assert "now: requests in flight are cut" in rows[first.pk].status_message


def test_a_stop_drains_and_a_replica_not_answering_has_nothing_to_drain(fleet, operator):
    deployment = _create(operator, "graceful", 0.2, 2)
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    first, second = Replica.objects.filter(deployment=deployment).order_by("serial")
    states.replica_transition(replica_id=first.pk, to=S.LOADING, source="t", runtime_handle="1")
    states.replica_transition(replica_id=first.pk, to=S.READY, source="t", generation=1)
    deployments.deployment_stop(deployment_id=deployment.pk, user=operator)
    first, second = Replica.objects.filter(deployment=deployment).order_by("serial")
    assert first.drain_until is not None and first.shown_status == "draining"  # the default 30 s
    assert second.drain_until is None and second.shown_status == "stopping"  # launching: it holds nothing
    # Its host's word on what it holds is on the row and the timeline; its end clears the deadline.
    replicas.replica_drain_told(replica_id=first.pk, in_flight=3, source="t", message="draining: 3 in flight")
    assert Replica.objects.get(pk=first.pk).in_flight == 3
    replicas.replica_drain_told(replica_id=first.pk, in_flight=0, source="t", message="drained in 2.0s", ended=True)
    first = Replica.objects.get(pk=first.pk)
    assert (first.in_flight, first.drain_until, first.shown_status) == (0, None, "stopping")
    assert Event.objects.filter(deployment=deployment, kind="replica.draining").count() == 2


def test_a_new_drain_timeout_needs_no_restart(api, fleet, operator):
    deployment = _create(operator, "tuned", 0.2, 1)
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    _ready(deployment)
    url = f"/api/deployments/{deployment.pk}/"
    assert api.patch(url, {"drain_timeout_s": 3601}, format="json").data["errors"]["drain_timeout_s"]
    changed = api.patch(url, {"drain_timeout_s": 120}, format="json")
    assert changed.status_code == 202, changed.data
    assert changed.data["drain_timeout_s"] == 120 and changed.data["status"] == "ready"
    assert not Replica.objects.filter(deployment=deployment, status=S.STOPPING).exists()


def test_an_auto_placement_runs_on_the_gpu_hosts_while_there_are_any(fleet, operator, host):
    factories.surveyed()
    deployment = deployments.deployment_create(
        name="auto", hosts=[], replicas=3,
        placements=[PlacementSpec(model="minilm", instance_kind="auto", gpu_memory_fraction=0.9)], user=operator,
    )  # fmt: skip
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    assert sorted(where for where, _ in _where(deployment)) == ["gpu-1", "gpu-2", "gpu-3"]
    # Six GPUs take six; the seventh is refused, not put on the CPU-only host beside them.
    deployments.deployment_scale(deployment_id=deployment.pk, replicas=6, user=operator)
    assert host.name not in {where for where, _ in _where(deployment)}
    with pytest.raises(InvalidTransition) as refused:
        deployments.deployment_scale(deployment_id=deployment.pk, replicas=7, user=operator)
    assert f"({host.name} without GPUs left out: instance_kind auto runs on a GPU" in str(refused.value)
    # Asked for the CPU, a replica may run there.
    factories.surveyed()
    cpu = deployments.deployment_create(
        name="cpu", hosts=[], replicas=4, placements=[PlacementSpec(model="minilm", instance_kind="KIND_CPU")],
        user=operator,
    )  # fmt: skip
    deployments.deployment_start(deployment_id=cpu.pk, user=operator)
    assert host.name in {where for where, _ in _where(cpu)}


def test_the_gpu_plan_counts_each_replica_by_its_own_generation(fleet, operator):
    deployment = _create(operator, "rolling", 0.2, 2, hosts=["gpu-1"], policy="pack")
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    first, second = _ready(deployment)
    _change_batch(deployment, operator, fraction=0.5)  # generation 2; the roll takes the first replica
    replicas.replica_ready(replica_id=first.pk, source="t", message="ok", from_status=S.UPDATING, generation=2)
    shares = {
        h.replica: sum(p.gpu_memory_fraction for p in h.placements)
        for h in selectors.plan_holders(GpuHost.objects.get(name="gpu-1"))
    }
    # The first serves generation 2 (0.5); the second still runs generation 1 (0.2), not 0.5.
    assert Replica.objects.get(pk=second.pk).generation == 1
    assert shares == {first.serial: 0.5, second.serial: 0.2}


def test_a_drained_host_s_replicas_move_and_each_goes_only_once_its_replacement_is_ready(api, fleet, operator):
    admin = User.objects.create_superuser(username="admin-drain", password="admin-pass")
    deployment = _create(operator, "moving", 0.3, 2, policy="spread")
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    first, second = _ready(deployment)
    drained = first.host.name

    # An operator may not cordon or drain; an admin may, naming the host.
    for action in ("cordon", "drain"):
        assert api.post(f"/api/hosts/{drained}/{action}/", format="json").status_code == 403
    api.force_authenticate(admin)
    assert api.post("/api/hosts/nowhere/drain/", format="json").status_code == 404
    answer = api.post(f"/api/hosts/{drained}/drain/", format="json")
    assert answer.status_code == 202, answer.data
    assert answer.data["host"]["cordoned"] is True
    [said] = answer.data["replicas"]
    assert said.startswith(f"moving {first.label}: moving to ")

    # The replacement starts elsewhere; the old one keeps serving until it is ready.
    replacement = Replica.objects.filter(deployment=deployment).order_by("-serial").first()
    assert replacement.host.name != drained and replacement.status == S.LAUNCHING
    assert Replica.objects.get(pk=first.pk).status == S.READY
    states.replica_transition(replica_id=replacement.pk, to=S.LOADING, source="t", runtime_handle="2")
    replicas.replica_ready(replica_id=replacement.pk, source="t", message="ok", from_status=S.LOADING, generation=1)
    old = Replica.objects.get(pk=first.pk)
    assert (old.status, old.desired_state, old.shown_status) == (S.STOPPING, "stopped", "draining")
    assert f"its host {drained} is cordoned: its replacement is ready" in old.status_message
    assert Replica.objects.get(pk=second.pk).status == S.READY

    # Nothing is placed on it any more, and a scale-up that finds no other room says why.
    deployments.deployment_scale(deployment_id=deployment.pk, replicas=3, user=operator)
    assert drained not in {r.host.name for r in Replica.objects.filter(deployment=deployment, desired_state="running")}
    assert any(e.kind == "host.cordon" for e in Event.objects.filter(host__name=drained))
    # Uncordoned, it takes replicas again.
    assert api.post(f"/api/hosts/{drained}/uncordon/", format="json").data["cordoned"] is False
    assert not GpuHost.objects.get(name=drained).is_cordoned
