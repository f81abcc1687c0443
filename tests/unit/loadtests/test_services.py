"""Starting, cancelling and finishing load tests: one at a time per deployment,
confirmed while real gateway keys use the model, and a context that keeps what
was under test."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import pytest
from django.utils import timezone

from common.errors import ConfirmationRequired, InvalidTransition, ValidationFailed
from core import queues
from gateway import services as gateway
from gateway.models import Alias, ApiKey
from hosts.models import OutboxMessage
from loadtests import runs, services
from loadtests.models import LoadTest, RunStatus
from tests import factories

pytestmark = pytest.mark.django_db


@pytest.fixture
def ready(minilm, host, operator):  # noqa: ANN001, ANN201
    deployment = factories.deployment(host=host, user=operator)
    deployment = factories.deployment_in(deployment, "launching", "loading", "ready")
    Alias.objects.create(name="embed", deployment=deployment, triton_name="minilm")
    return deployment


def _start(ready, operator, **kwargs):  # noqa: ANN001, ANN003, ANN202
    spec = kwargs.pop("spec", {"request_count": 5})
    return services.run_create(deployment_id=ready.pk, alias="embed", spec=spec, user=operator, **kwargs)


def test_a_run_is_queued_on_its_hosts_worker_with_what_was_under_test(ready, operator):  # noqa: ANN001
    run = _start(ready, operator)
    assert run.status == RunStatus.QUEUED and run.kind == "embedding" and run.triton_name == "minilm"
    assert run.context["deployment"]["generation"] == ready.generation
    assert [p["triton_name"] for p in run.context["placements"]] == ["minilm"]
    assert run.context["placements"][0]["under_test"] and run.context["gantry_version"]
    message = OutboxMessage.objects.get(task=queues.RUN_LOADTEST)
    # The run's gateway key travels with its task: the host's credentials may not make keys.
    assert message.queue == queues.jobs_queue(run.host.name) and message.args[0] == run.pk
    key = ApiKey.objects.get(name=f"{runs.KEY_NAME_PREFIX}{run.pk}", revoked_at=None)
    assert key.prefix and message.args[1].startswith(key.prefix)
    assert list(key.aliases.values_list("name", flat=True)) == [run.alias]
    assert ready.events.filter(kind="loadtest.queued").exists()


def test_a_second_run_on_the_same_deployment_is_refused_while_one_is_active(ready, operator):  # noqa: ANN001
    first = _start(ready, operator)
    with pytest.raises(InvalidTransition, match=f"load test {first.pk} is still queued"):
        _start(ready, operator)
    services.run_cancel(run_id=first.pk, user=operator)
    assert _start(ready, operator).status == RunStatus.QUEUED


def test_live_gateway_keys_on_the_model_need_a_confirmation(ready, operator):  # noqa: ANN001
    gateway.key_create(name="production app", user=operator, alias_names=["embed"])
    with pytest.raises(ConfirmationRequired, match="production app"):
        _start(ready, operator)
    assert not LoadTest.objects.exists()
    assert _start(ready, operator, confirm=True).status == RunStatus.QUEUED


def test_revoked_expired_and_load_test_keys_need_no_confirmation(ready, operator):  # noqa: ANN001
    revoked = gateway.key_create(name="old", user=operator, all_aliases=True).key
    gateway.key_revoke(key_id=revoked.pk, user=operator)
    expired = gateway.key_create(name="expired", user=operator, all_aliases=True).key
    type(expired).objects.filter(pk=expired.pk).update(expires_at=timezone.now() - dt.timedelta(minutes=1))
    gateway.key_create(name=f"{runs.KEY_NAME_PREFIX}9", user=operator, alias_names=["embed"])
    assert _start(ready, operator).status == RunStatus.QUEUED


def test_a_deployment_that_is_not_ready_is_not_load_tested(minilm, host, operator):  # noqa: ANN001
    stopped = factories.deployment(host=host, user=operator)
    Alias.objects.create(name="embed", deployment=stopped, triton_name="minilm")
    with pytest.raises(InvalidTransition, match="needs it ready"):
        _start(stopped, operator)


def test_an_alias_of_another_deployment_is_refused_by_field(ready, operator):  # noqa: ANN001
    with pytest.raises(ValidationFailed) as refused:
        services.run_create(deployment_id=ready.pk, alias="nope", spec={"request_count": 5}, user=operator)
    assert "embed" in refused.value.errors["model"][0]


def test_a_viewer_cannot_start_a_run(ready, viewer):  # noqa: ANN001
    from common.errors import PermissionDenied

    with pytest.raises(PermissionDenied):
        _start(ready, viewer)


def test_a_running_run_is_asked_to_stop_and_ends_cancelled_keeping_its_steps(ready, operator):  # noqa: ANN001
    run = _start(ready, operator)
    assert services.run_claim(run_id=run.pk, source="worker:h") is not None
    assert services.run_claim(run_id=run.pk, source="worker:h") is None  # a second delivery does nothing
    now = timezone.now()
    services.point_save(run_id=run.pk, target="gateway", level=1, complete=True, summary={"request_throughput": 3},
                        records=[], server={}, started_at=now, finished_at=now)  # fmt: skip
    assert services.run_cancel(run_id=run.pk, user=operator).status == RunStatus.CANCELLING
    assert services.run_report(run_id=run.pk, progress={"step": 2}) == RunStatus.CANCELLING
    ended = services.run_finish(run_id=run.pk, status=RunStatus.CANCELLED, message="cancelled", source="worker:h")
    assert ended.status == RunStatus.CANCELLED and ended.finished_at is not None
    assert run.points.count() == 1
    with pytest.raises(InvalidTransition):
        services.run_cancel(run_id=run.pk, user=operator)


def test_a_run_whose_worker_went_quiet_is_failed_by_the_reaper(ready, operator):  # noqa: ANN001
    run = _start(ready, operator)
    services.run_claim(run_id=run.pk, source="worker:h")
    LoadTest.objects.filter(pk=run.pk).update(heartbeat_at=timezone.now() - dt.timedelta(minutes=5))
    assert services.runs_reap() == 1
    failed = LoadTest.objects.get(pk=run.pk)
    assert failed.status == RunStatus.FAILED and "stopped reporting" in failed.status_message


def test_an_active_run_is_not_deleted(ready, operator):  # noqa: ANN001
    run = _start(ready, operator)
    with pytest.raises(InvalidTransition):
        services.run_delete(run_id=run.pk, user=operator)
    services.run_cancel(run_id=run.pk, user=operator)
    services.run_delete(run_id=run.pk, user=operator)
    assert not LoadTest.objects.exists()


@pytest.mark.parametrize("pid_recorded", [True, False], ids=["pid-recorded", "killed-before-the-pid-was-recorded"])
def test_a_run_left_by_a_dead_worker_has_its_load_generator_stopped_and_fails(
    ready, operator, settings, tmp_path, pid_recorded: bool
):  # noqa: ANN001
    import subprocess
    import sys

    from gateway.models import ApiKey
    from workers import processes
    from workers.loadtest import runs as host_runs

    settings.GANTRY_HOST_NAME, settings.GANTRY_DATA_DIR = ready.replica_set.get().host.name, tmp_path
    run = _start(ready, operator)
    services.run_claim(run_id=run.pk, source="worker:h")
    # What a SIGKILLed worker leaves: the generator in a group of its own, working in the run's folder.
    folder = host_runs.run_folder(run.pk) / "0-gateway"
    folder.mkdir(parents=True)
    left = processes.start_group([sys.executable, "-c", "import time; time.sleep(120)"], cwd=folder,
                                 stdout=subprocess.DEVNULL)  # fmt: skip
    LoadTest.objects.filter(pk=run.pk).update(progress={"step": 1, "pid": left.pid} if pid_recorded else {})
    host_runs.reconcile_runs()  # heartbeated just now: still its worker's
    assert LoadTest.objects.get(pk=run.pk).status == RunStatus.RUNNING and left.poll() is None
    LoadTest.objects.filter(pk=run.pk).update(heartbeat_at=timezone.now() - dt.timedelta(seconds=60))
    host_runs.reconcile_runs()
    assert left.wait(timeout=15) is not None
    failed = LoadTest.objects.get(pk=run.pk)
    assert failed.status == RunStatus.FAILED and "stopped (killed or restarted)" in failed.status_message
    # Its key lives until the beat's pass over ended runs revokes it.
    assert ApiKey.objects.get(name=f"{runs.KEY_NAME_PREFIX}{run.pk}").revoked_at is None
    assert runs.ended_keys_revoke() == 1 and runs.ended_keys_revoke() == 0
    assert ApiKey.objects.get(name=f"{runs.KEY_NAME_PREFIX}{run.pk}").revoked_at is not None


# --- the native ceiling: where trtllm-bench can run ---------------------------------


def _engine_placement(*, installed: str, built_with: str = "0.20.0", build: bool = True):  # noqa: ANN202
    host = SimpleNamespace(pk=1, name="h100-host", builders={"images": {}, "native": installed})
    engine = SimpleNamespace(pk=3, host_id=1, trtllm_version=built_with) if build else None
    placement = SimpleNamespace(triton_name="llama", backend="python", engine_build=engine)
    return host, placement


def test_the_native_ceiling_needs_the_hosts_own_tensorrt_llm_at_the_engines_version():
    assert services.native_refusal(*_engine_placement(installed="0.20.0")) == ""
    none = services.native_refusal(*_engine_placement(installed=""))
    assert "h100-host has no TensorRT-LLM (set GANTRY_TRTLLM_PYTHON there)" in none
    other = services.native_refusal(*_engine_placement(installed="0.16.0"))
    assert "h100-host has TensorRT-LLM 0.16.0, and engine build 3 was built with 0.20.0" in other


def test_the_native_ceiling_needs_an_engine_and_a_trtllm_bench_that_reports():
    served = services.native_refusal(*_engine_placement(installed="0.20.0", build=False))
    assert served.startswith("llama is served by python, not from a TensorRT-LLM engine build")
    old = services.native_refusal(*_engine_placement(installed="0.16.0", built_with="0.16.0"))
    assert "trtllm-bench of TensorRT-LLM 0.16.0 has no --report_json" in old


def test_a_workload_rule_is_named_as_the_apis_own_fields_are(ready, operator):  # noqa: ANN001
    with pytest.raises(ValidationFailed) as refused:
        _start(ready, operator, spec={"levels": [1.5], "request_count": 5, "thresholds": {"time_to_first_token_ms": 9}})
    assert set(refused.value.errors) == {"workload.levels", "workload.thresholds.time_to_first_token_ms"}


def test_an_embedder_asked_for_a_native_ceiling_is_refused_by_field(ready, operator):  # noqa: ANN001
    with pytest.raises(ValidationFailed) as refused:
        _start(ready, operator, spec={"request_count": 5, "native": True})
    assert "TensorRT-LLM engines" in refused.value.errors["workload.native"][0]
    assert not LoadTest.objects.exists()
