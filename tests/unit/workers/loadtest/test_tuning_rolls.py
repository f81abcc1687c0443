"""A tuning trial's generation as the worker waits for it: measured once
every replica serves it; a failed trial (and the search goes on) when it did
not load and the deployment rolled back."""

from __future__ import annotations

import pytest

from deployments.models import Deployment, Replica
from deployments.services import generations
from gateway.models import Alias
from loadtests import tuning_services
from loadtests.models import TrialStatus
from tests import factories
from workers.loadtest import tuning as worker

pytestmark = pytest.mark.django_db


@pytest.fixture
def trial(minilm, host, operator):  # noqa: ANN001, ANN201
    deployment = factories.deployment(host=host, user=operator)
    deployment = factories.deployment_in(deployment, "launching", "loading", "ready")
    Alias.objects.create(name="embed", deployment=deployment, triton_name="minilm")
    run = tuning_services.tuning_create(
        deployment_id=deployment.pk, user=operator,
        spec={"mix": [{"model": "embed", "rate": 1.0, "targets": {"request_latency_ms": 50.0}}],
              "space": {"minilm": {"max_batch_size": [2, 4]}}, "trial_s": 10, "budget_s": 600},
    )  # fmt: skip
    tuning_services.tuning_claim(run_id=run.pk, source="worker")
    started = tuning_services.trial_start(run_id=run.pk, number=1, params={"minilm.max_batch_size": 2})
    assert started.status == TrialStatus.RUNNING
    return started


def test_a_trial_is_measured_once_every_replica_serves_its_generation(trial):  # noqa: ANN001
    Replica.objects.filter(deployment=trial.run.deployment).update(status="ready", generation=trial.generation)
    Deployment.objects.filter(pk=trial.run.deployment_id).update(status="ready")
    assert worker._rolled(trial.run, trial) == ""


def test_a_generation_that_did_not_load_fails_the_trial_with_the_reason(trial):  # noqa: ANN001
    generations.deployment_rollback(
        deployment_id=trial.run.deployment_id, failed_generation=trial.generation,
        reason="minilm: failed to load (out of memory)", source="worker",
    )  # fmt: skip
    Replica.objects.filter(deployment=trial.run.deployment).update(status="ready")
    Deployment.objects.filter(pk=trial.run.deployment_id).update(status="ready")
    said = worker._rolled(trial.run, trial)
    assert said == f"generation {trial.generation} did not load: minilm: failed to load (out of memory)"
