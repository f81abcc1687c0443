"""Tuning runs: the spec checked against the deployment by field, the search's
next values (the grid in turn, else optuna's TPE told every earlier trial),
goodput scored from per-request records, and the service's rules (one run at
a time and never beside a load test, trials pruned when they cannot be
placed, the starting settings put back however a run ends, or the winner kept
in one roll-out when asked, apply)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from common.errors import ConfirmationRequired, InvalidTransition, ValidationFailed
from core import queues
from deployments.models import Deployment, Replica
from deployments.services import deployments
from deployments.services.deployments import ServerSpec
from deployments.services.placements import spec_from_snapshot
from gateway import services as gateway
from gateway.models import Alias
from hosts.models import OutboxMessage
from loadtests import selectors, services, tuning
from loadtests import tuning_services as tunings
from loadtests.models import RunStatus, TrialStatus, TuningRun
from tests import factories

SPACE = {"minilm": {"max_batch_size": [1, 8], "instance_count": {"low": 1, "high": 3, "step": 1}}}
MIX = [{"model": "embed", "rate": 5.0, "targets": {"request_latency_ms": 50.0}}]


def _spec(**overrides):  # noqa: ANN003, ANN202
    return {"mix": MIX, "space": SPACE, "trial_s": 10, "budget_s": 600, **overrides}


def _check(**overrides):  # noqa: ANN003, ANN202
    return tuning.check(_spec(**overrides), placements={"minilm": "embedding", "tiny": "llm"},
                        aliases={"embed": "minilm", "chat": "tiny"})  # fmt: skip


def test_a_small_space_is_searched_as_a_grid_and_each_alias_gets_a_rate_workload():
    spec = _check()
    assert spec["search"] == "grid" and spec["grid_size"] == 6 and spec["max_trials"] == 6
    workload = spec["mix"][0]["workload"]
    assert workload["mode"] == "rate" and workload["levels"] == [5.0] and workload["duration_s"] == 10
    assert spec["mix"][0]["triton_name"] == "minilm" and spec["mix"][0]["kind"] == "embedding"
    assert _check(max_trials=4)["search"] == "tpe"


def test_a_spec_that_does_not_fit_the_deployment_is_refused_by_field():
    with pytest.raises(ValidationFailed) as refused:
        _check(
            mix=[{"model": "nope", "rate": 1.0, "targets": {"request_latency_ms": 5.0}},
                 {"model": "embed", "rate": 1.0, "targets": {"time_to_first_token_ms": 5.0}, "output_tokens": 9},
                 {"model": "chat", "rate": 1.0, "targets": {}}],
            space={"ghost": {"max_batch_size": [1]}, "minilm": {"dtype": ["float16"],
                   "gpu_memory_fraction": {"low": 0.1, "high": 0.9, "step": 0.01}, "instance_count": [1, 1],
                   "max_batch_size": ["8"]}},
        )  # fmt: skip
    errors = refused.value.errors
    assert "no gateway alias 'nope'" in errors["mix[0].model"][0]
    assert "not a target of embedding models" in errors["mix[1].targets.time_to_first_token_ms"][0]
    assert "does not apply" in errors["mix[1].output_tokens"][0]
    assert "give a TTFT" in errors["mix[2].targets"][0]
    assert "has no model 'ghost'" in errors["space.ghost"][0]
    assert "not a searchable setting" in errors["space.minilm.dtype"][0]
    assert "at most 16 values" in errors["space.minilm.gpu_memory_fraction"][0]
    assert errors["space.minilm.instance_count"] == ["each value once"]
    assert errors["space.minilm.max_batch_size"] == ["values of type int"]
    with pytest.raises(ValidationFailed, match="nothing to search"):
        _check(space={"minilm": {"max_batch_size": [8]}})
    with pytest.raises(ValidationFailed, match="at least one trial"):
        _check(trial_s=600, budget_s=600)


def test_the_grid_is_tried_point_by_point_and_then_ends():
    spec = _check()
    tried: list = []
    while (params := tuning.next_params(spec, tried)) is not None:
        assert params not in [p for p, _, _ in tried]
        tried.append((params, "measured", 1.0))
    assert len(tried) == 6
    assert {(p["minilm.max_batch_size"], p["minilm.instance_count"]) for p, _, _ in tried} == {
        (b, n) for b in (1, 8) for n in (1, 2, 3)
    }


def test_tpe_learns_from_every_earlier_trial_and_stays_within_the_space():
    space = {"max_batch_size": [1, 2, 4, 8, 16, 32], "max_queue_delay_us": {"low": 0, "high": 5000, "step": 500}}
    spec = _check(space={"minilm": space}, max_trials=20)
    assert spec["search"] == "tpe"
    tried: list = []
    for i in range(12):
        params = tuning.next_params(spec, tried)
        assert params["minilm.max_batch_size"] in (1, 2, 4, 8, 16, 32)
        assert params["minilm.max_queue_delay_us"] in range(0, 5001, 500)
        status = ("measured", "pruned", "failed")[i % 3]
        tried.append((params, status, float(params["minilm.max_batch_size"]) if status == "measured" else None))
    tried.append(({"older.knob": 1}, "measured", 3.0))  # a trial of another space says nothing here
    offered = tuning.next_params(spec, tried)
    assert offered is not None and offered not in [p for p, _, _ in tried]  # a plan is measured once
    measured = [(p, "measured", 1.0) for p, _, _ in tried]
    assert tuning.next_params(spec, measured * 2) is None  # the trial bound


def test_pruned_plans_do_not_count_against_the_trial_bound_but_end_a_search_of_nothing_else():
    spec = _check(max_trials=2, space={"minilm": {"max_batch_size": list(range(1, 17)),
                                                  "instance_count": [1, 2, 3]}})  # fmt: skip
    tried = [({"minilm.max_batch_size": b, "minilm.instance_count": 1}, "pruned", None) for b in range(1, 8)]
    assert tuning.next_params(spec, tried) is not None
    assert tuning.next_params(spec, tried + tried[:1]) is None  # 4 pruned per allowed trial


def test_goodput_counts_the_requests_that_met_every_target():
    entry = {"rate": 4.0, "targets": {"time_to_first_token_ms": 100.0, "inter_token_latency_ms": 20.0}}
    records = [{"ttft_ms": 50.0, "itl_ms": 10.0}] * 30 + [{"ttft_ms": 150.0, "itl_ms": 10.0}] * 5
    records += [{"ttft_ms": 50.0, "itl_ms": 30.0}] * 3 + [{"ttft_ms": None, "itl_ms": None, "error": "500"}] * 2
    figures = tuning.score(entry, records, duration_s=10.0)
    assert figures["requests"] == 40 and figures["errors"] == 2 and figures["good"] == 30
    assert figures["goodput"] == 3.0 and figures["throughput"] == 3.8
    assert figures["p99"]["time_to_first_token_ms"] == 150.0 and not figures["met"]
    assert tuning.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5


def test_the_best_trial_has_the_most_goodput_then_the_least_gpu_memory():
    trials = [SimpleNamespace(number=n, goodput=g, gpu_share=s)
              for n, g, s in ((0, 5.0, 0.5), (1, 9.0, 0.4), (2, 9.0, 0.3), (3, None, 0.0))]  # fmt: skip
    assert tuning.best(trials).number == 2
    assert tuning.best([trials[3]]) is None


# --- the service -------------------------------------------------------------------


@pytest.fixture
def ready(minilm, host, operator):  # noqa: ANN001, ANN201
    deployment = factories.deployment(host=host, user=operator)
    deployment = factories.deployment_in(deployment, "launching", "loading", "ready")
    Alias.objects.create(name="embed", deployment=deployment, triton_name="minilm")
    return deployment


def _rolled(deployment: Deployment) -> None:
    """Its replicas took the newest generation (as the worker reports it)."""
    generation = Deployment.objects.get(pk=deployment.pk).generation
    Replica.objects.filter(deployment=deployment).update(status="ready", generation=generation)
    Deployment.objects.filter(pk=deployment.pk).update(status="ready")


def _start(ready, operator, spec=None, **kwargs):  # noqa: ANN001, ANN003, ANN202
    return tunings.tuning_create(deployment_id=ready.pk, spec=spec or _spec(), user=operator, **kwargs)


@pytest.mark.django_db
def test_a_run_is_queued_on_the_jobs_queue_with_its_starting_plan(ready, operator):  # noqa: ANN001
    run = _start(ready, operator)
    assert run.status == RunStatus.QUEUED and run.start_generation == ready.generation
    assert [p["triton_name"] for p in run.start_plan] == ["minilm"]
    message = OutboxMessage.objects.get(task=queues.RUN_TUNING)
    assert message.queue == queues.jobs_queue(run.host.name) and message.args[0] == run.pk
    assert message.args[1].startswith("gk-")  # its gateway key, issued by the control plane
    assert "grid search of 6 plan(s)" in ready.events.get(kind="tuning.queued").message


@pytest.mark.django_db
def test_a_run_and_a_load_test_never_share_a_deployment(ready, operator):  # noqa: ANN001
    run = _start(ready, operator)
    with pytest.raises(InvalidTransition, match="already active"):
        _start(ready, operator)
    with pytest.raises(InvalidTransition, match=f"tuning run {run.pk} is queued"):
        services.run_create(deployment_id=ready.pk, alias="embed", spec={"request_count": 5}, user=operator)
    tunings.tuning_cancel(run_id=run.pk, user=operator)
    test = services.run_create(deployment_id=ready.pk, alias="embed", spec={"request_count": 5}, user=operator)
    with pytest.raises(InvalidTransition, match=f"load test {test.pk} is queued"):
        _start(ready, operator)


@pytest.mark.django_db
def test_live_gateway_keys_on_the_mix_need_a_confirmation(ready, operator):  # noqa: ANN001
    gateway.key_create(name="production app", user=operator, alias_names=["embed"])
    with pytest.raises(ConfirmationRequired, match="production app"):
        _start(ready, operator)
    assert not TuningRun.objects.exists()
    assert _start(ready, operator, confirm=True).status == RunStatus.QUEUED


@pytest.mark.django_db
def test_a_trial_that_cannot_be_placed_is_pruned_and_the_run_ends_with_its_start_back(ready, operator):  # noqa: ANN001
    run = _start(ready, operator)
    tunings.tuning_claim(run_id=run.pk, source="worker")
    pruned = tunings.trial_start(run_id=run.pk, number=0, params={"minilm.preferred_batch_sizes": [64]})
    assert pruned.status == TrialStatus.PRUNED and "preferred_batch_sizes" in pruned.reason
    assert Deployment.objects.get(pk=ready.pk).generation == ready.generation
    assert ready.events.filter(kind="tuning.trial.pruned").exists()

    trial = tunings.trial_start(run_id=run.pk, number=1, params={"minilm.max_batch_size": 4})
    assert trial.status == TrialStatus.RUNNING and trial.generation == ready.generation + 1
    assert Deployment.objects.get(pk=ready.pk).placements.get().max_batch_size == 4
    tunings.trial_end(trial_id=trial.pk, status=TrialStatus.MEASURED, figures={"embed": {}}, goodput=4.5)
    # Mid-roll, the starting settings cannot be put back yet: the run says so.
    stuck = tunings.tuning_settle(TuningRun.objects.get(pk=run.pk))
    assert not stuck.held and "could not be put back yet" in stuck.said and "updating" in stuck.said
    _rolled(ready)

    ended = tunings.tuning_finish(run_id=run.pk, status=RunStatus.SUCCEEDED, message="done", source="worker")
    back = Deployment.objects.get(pk=ready.pk)
    assert ended.status == RunStatus.SUCCEEDED and back.generation == ready.generation + 2
    assert back.placements.get().max_batch_size == run.start_plan[0]["max_batch_size"]
    assert f"the settings of generation {ready.generation} are back" in ended.status_message

    _rolled(ready)
    applied = tunings.tuning_apply(run_id=run.pk, user=operator)
    assert applied.applied_generation == ready.generation + 3
    assert Deployment.objects.get(pk=ready.pk).placements.get().max_batch_size == 4
    result = selectors.tuning_result(applied)
    assert result["best"] == 1 and result["changes"] == [
        {"model": "minilm", "field": "max_batch_size", "from": run.start_plan[0]["max_batch_size"], "to": 4}
    ]
    rows = selectors.tuning_rows(applied)
    assert [r["status"] for r in rows] == ["pruned", "measured"] and rows[1]["param.minilm.max_batch_size"] == 4


@pytest.mark.django_db
def test_nothing_is_applied_before_a_trial_was_measured(ready, operator):  # noqa: ANN001
    run = _start(ready, operator)
    with pytest.raises(InvalidTransition, match="when it has ended"):
        tunings.tuning_apply(run_id=run.pk, user=operator)
    tunings.tuning_cancel(run_id=run.pk, user=operator)
    with pytest.raises(ValidationFailed, match="no trial was measured"):
        tunings.tuning_apply(run_id=run.pk, user=operator)


@pytest.mark.django_db
def test_a_persons_change_waits_for_the_run_that_holds_the_deployment(ready, operator):  # noqa: ANN001
    # The run puts its starting settings back when it ends, over whatever was changed meanwhile.
    run = _start(ready, operator)
    smaller = [replace(spec_from_snapshot(item), max_batch_size=2) for item in run.start_plan]
    with pytest.raises(InvalidTransition, match=f"tuning run {run.pk} holds {ready.name}'s settings until it ends"):
        deployments.deployment_change(deployment_id=ready.pk, placements=smaller, user=operator)
    with pytest.raises(InvalidTransition, match=f"tuning run {run.pk} holds"):
        deployments.deployment_configure(deployment_id=ready.pk, server=ServerSpec(log_verbose=1), user=operator)
    assert Deployment.objects.get(pk=ready.pk).generation == ready.generation  # nothing written
    tunings.tuning_claim(run_id=run.pk, source="worker")
    trial = tunings.trial_start(run_id=run.pk, number=0, params={"minilm.max_batch_size": 4})
    assert trial.generation == ready.generation + 1  # the run's own change goes through
    _rolled(ready)
    tunings.tuning_finish(run_id=run.pk, status=RunStatus.SUCCEEDED, message="done", source="worker")
    _rolled(ready)
    changed = deployments.deployment_change(deployment_id=ready.pk, placements=smaller, user=operator)
    assert changed.placements.get().max_batch_size == 2


@pytest.mark.django_db
def test_a_trial_of_the_plan_the_deployment_holds_is_measured_as_it_is(ready, operator):  # noqa: ANN001
    run = _start(ready, operator)
    tunings.tuning_claim(run_id=run.pk, source="worker")
    same = {"minilm.max_batch_size": run.start_plan[0]["max_batch_size"]}
    trial = tunings.trial_start(run_id=run.pk, number=0, params=same)
    assert trial.status == TrialStatus.RUNNING and trial.generation == ready.generation
    restored = tunings.tuning_settle(TuningRun.objects.get(pk=run.pk))
    assert restored == (True, f"{ready.name} holds its starting settings (generation {ready.generation})", None)


@pytest.mark.django_db
def test_a_restore_that_cannot_be_made_at_the_end_is_retried_until_it_holds(ready, operator):  # noqa: ANN001
    run = _start(ready, operator)
    tunings.tuning_claim(run_id=run.pk, source="worker")
    tunings.trial_start(run_id=run.pk, number=0, params={"minilm.max_batch_size": 4})
    # The run ends mid-roll: its deployment cannot take a change, so its start is not back yet.
    ended = tunings.tuning_finish(run_id=run.pk, status=RunStatus.SUCCEEDED, message="done", source="worker")
    assert ended.status == RunStatus.SUCCEEDED and ended.restore_pending
    assert "could not be put back yet" in ended.status_message and "tries again" in ended.status_message
    smaller = [replace(spec_from_snapshot(item), max_batch_size=2) for item in run.start_plan]
    with pytest.raises(InvalidTransition, match=f"tuning run {run.pk} holds"):  # held until its start is back
        deployments.deployment_change(deployment_id=ready.pk, placements=smaller, user=operator)
    assert tunings.tunings_restore_pending() == 0  # still rolling: tried again later
    _rolled(ready)
    assert tunings.tunings_restore_pending() == 1
    back = TuningRun.objects.get(pk=run.pk)
    assert not back.restore_pending and f"then the settings of generation {ready.generation} are back" in (
        back.status_message
    )
    assert Deployment.objects.get(pk=ready.pk).placements.get().max_batch_size == run.start_plan[0]["max_batch_size"]
    assert ready.events.filter(kind="tuning.restored").count() == 1
    _rolled(ready)
    assert deployments.deployment_change(deployment_id=ready.pk, placements=smaller, user=operator)
    assert tunings.tunings_restore_pending() == 0


def _ending_on_best(ready, operator):  # noqa: ANN001, ANN202
    """A run asked to end on its winner, claimed by its worker."""
    run = _start(ready, operator, spec=_spec(end_on="best"))
    tunings.tuning_claim(run_id=run.pk, source="worker")
    return run


def _measured(run, number: int, batch: int, goodput: float, *, met: bool):  # noqa: ANN001, ANN202
    trial = tunings.trial_start(run_id=run.pk, number=number, params={"minilm.max_batch_size": batch})
    return tunings.trial_end(trial_id=trial.pk, status=TrialStatus.MEASURED, figures={"embed": {"met": met}},
                             goodput=goodput)  # fmt: skip


@pytest.mark.django_db
def test_a_run_asked_to_end_on_its_winner_rolls_to_it_once(ready, operator):  # noqa: ANN001
    run = _start(ready, operator, spec=_spec(end_on="best"))
    assert run.spec["end_on"] == "best" and _check()["end_on"] == "start"
    tunings.tuning_claim(run_id=run.pk, source="worker")
    _measured(run, 0, 4, 9.0, met=True)
    _rolled(ready)
    _measured(run, 1, 2, 3.0, met=True)
    _rolled(ready)
    last = Deployment.objects.get(pk=ready.pk).generation
    ended = tunings.tuning_finish(run_id=run.pk, status=RunStatus.SUCCEEDED, message="done", source="worker")
    held = Deployment.objects.get(pk=ready.pk)
    # One roll-out, from the last trial's plan straight to the winner's: the start is not put back first.
    assert held.generation == last + 1 and held.placements.get().max_batch_size == 4
    assert ended.applied_generation == last + 1 and not ended.restore_pending
    assert f"trial 0's plan (9 good requests/s) is in place, as generation {last + 1}" in ended.status_message


@pytest.mark.django_db
def test_a_winner_already_held_costs_no_roll_out_and_a_run_that_met_nothing_ends_on_its_start(
    ready,
    operator,  # noqa: ANN001
):
    run = _ending_on_best(ready, operator)
    _measured(run, 0, 4, 9.0, met=True)
    _rolled(ready)
    held = Deployment.objects.get(pk=ready.pk).generation
    ended = tunings.tuning_finish(run_id=run.pk, status=RunStatus.SUCCEEDED, message="done", source="worker")
    assert Deployment.objects.get(pk=ready.pk).generation == held and ended.applied_generation == held
    assert f"holds trial 0's plan (9 good requests/s) (generation {held})" in ended.status_message

    missed = _ending_on_best(ready, operator)
    _measured(missed, 0, 2, 5.0, met=False)
    _rolled(ready)
    ended = tunings.tuning_finish(run_id=missed.pk, status=RunStatus.SUCCEEDED, message="done", source="worker")
    assert ended.applied_generation is None
    assert "no plan met every target, so the settings of generation" in ended.status_message
    assert Deployment.objects.get(pk=ready.pk).placements.get().max_batch_size == 4  # its start: the last winner


@pytest.mark.django_db
def test_a_cancelled_run_ends_on_its_start_and_a_winner_blocked_mid_roll_is_put_in_place_later(
    ready,
    operator,  # noqa: ANN001
):
    run = _ending_on_best(ready, operator)
    _measured(run, 0, 4, 9.0, met=True)
    _rolled(ready)
    tunings.tuning_cancel(run_id=run.pk, user=operator)
    ended = tunings.tuning_finish(run_id=run.pk, status=RunStatus.SUCCEEDED, message="done", source="worker")
    assert ended.status == RunStatus.CANCELLED and ended.applied_generation is None
    assert Deployment.objects.get(pk=ready.pk).placements.get().max_batch_size == run.start_plan[0]["max_batch_size"]
    _rolled(ready)

    second = _ending_on_best(ready, operator)
    _measured(second, 0, 2, 9.0, met=True)
    _rolled(ready)
    _measured(second, 1, 4, 1.0, met=True)  # still rolling when the run ends
    ended = tunings.tuning_finish(run_id=second.pk, status=RunStatus.SUCCEEDED, message="done", source="worker")
    assert ended.restore_pending and "trial 0's plan (9 good requests/s) could not be put in place yet" in (
        ended.status_message
    )
    _rolled(ready)
    assert tunings.tunings_restore_pending() == 1
    back = TuningRun.objects.get(pk=second.pk)
    assert not back.restore_pending and back.applied_generation == Deployment.objects.get(pk=ready.pk).generation
    assert Deployment.objects.get(pk=ready.pk).placements.get().max_batch_size == 2
