"""Load tests as people and workers ask for them: start one (checked, one at a
time per deployment, confirmed when real clients use the deployment), cancel
it, the worker's writes while it runs (claim, its gateway key, progress, each
step's figures, finish), and the reaper for runs whose worker went quiet.

A load test is a run kind (loadtests.runs, which writes what every run kind
shares); its status moves only through ``run_transition``.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from common import metrics
from common.errors import InvalidTransition, NotFound, ValidationFailed
from common.version import gantry_version
from core import events, queues
from core.permissions import require_operator
from deployments.models import Deployment, DeploymentModel, DeploymentStatus
from gateway.models import Alias
from hosts import outbox
from hosts.models import GpuHost
from loadtests import runs
from loadtests import workload as workloads
from loadtests.models import ACTIVE, LoadPoint, LoadTest, RunStatus
from upstream import trtllm


def _about(run: LoadTest) -> tuple[str, dict[str, Any]]:
    return f"load test {run.pk} of {run.alias}", {"load_test": run.pk, "alias": run.alias}


LOAD_TEST = runs.register(
    runs.RunKind(
        name="load test",
        event="loadtest",
        model=LoadTest,
        task=queues.RUN_LOADTEST,
        key_name=runs.KEY_NAME_PREFIX + "{}",
        key_aliases=lambda run: [run.alias],
        key_valid_s=lambda run: runs.KEY_VALID_S,
        about=_about,
        kept="the steps it finished",
    )
)


def run_transition(*, run_id: int, to: str, source: str, message: str = "", actor: Any = None) -> LoadTest:
    """Move run ``run_id`` to ``to`` if the table allows it from where it is (a
    compare-and-swap, core.jobs), and put it on its deployment's timeline."""
    return runs.transition(LOAD_TEST, run_id=run_id, to=to, source=source, message=message, actor=actor)


def run_create(
    *, deployment_id: int, alias: str, spec: dict[str, Any], confirm: bool = False, user: Any = None
) -> LoadTest:
    """Ask the deployment's host to load-test ``alias`` (one of this deployment's
    gateway model names) with the workload ``spec``. Refused by field when the
    spec does not fit the model; refused while another run is active; refused
    with code confirmation_required, until ``confirm``, when live gateway keys
    other than load tests' may use the alias (their requests would slow)."""
    require_operator(user)
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        target = Alias.objects.filter(name=alias, deployment=deployment).first()
        if target is None:
            names = sorted(deployment.aliases.values_list("name", flat=True))
            hint = f"its aliases: {', '.join(names)}" if names else "it has none: add one on the gateway page"
            raise ValidationFailed({"model": f"no gateway alias {alias!r} points at {deployment.name} ({hint})"})
        placement = deployment.placements.select_related("registered_model", "engine_build")
        placement = placement.filter(triton_name=target.triton_name)
        placement = placement.first()
        if placement is None:
            raise ValidationFailed({"model": f"{deployment.name} no longer serves {target.triton_name}"})
        checked = _checked(placement.registered_model.kind, spec)
        home = deployment.replica_set.select_related("host").filter(status=DeploymentStatus.READY).order_by("serial")
        home = home.first()
        if checked["native"] and home is not None:
            refusal = native_refusal(home.host, placement)
            if refusal:
                raise ValidationFailed({"workload.native": refusal})
        if deployment.status != DeploymentStatus.READY or home is None:
            raise InvalidTransition(f"{deployment.name} is {deployment.status}; a load test needs it ready")
        tuning = deployment.tuning_runs.filter(status__in=ACTIVE).first()
        if tuning is not None:
            raise InvalidTransition(f"tuning run {tuning.pk} is {tuning.status} on {deployment.name}: one at a time")
        keys = [key.name for key in runs.production_keys(target)]
        runs.require_confirmed(keys, confirm=confirm, uses=alias, why="their requests will slow while this runs")
        try:
            with transaction.atomic():
                run = LoadTest.objects.create(
                    deployment=deployment,
                    deployment_name=deployment.name,
                    host=home.host,
                    alias=alias,
                    triton_name=placement.triton_name,
                    kind=placement.registered_model.kind,
                    workload=checked,
                    context=context_of(deployment, home.host, placement.triton_name),
                    created_by=events.signed_in(user),
                )
        except IntegrityError:
            active = LoadTest.objects.filter(deployment=deployment, status__in=ACTIVE).first()
            raise InvalidTransition(
                f"load test {active.pk if active else '?'} is still {active.status if active else 'active'} on "
                f"{deployment.name}: one run at a time per deployment"
            ) from None
        events.record(
            kind="loadtest.queued",
            source=events.source_of(user),
            actor=user,
            deployment=deployment,
            to_status=RunStatus.QUEUED,
            message=f"load test {run.pk} of {alias} asked for ({_describe(checked)})",
            data={"load_test": run.pk, "alias": alias, "confirmed": bool(keys)},
        )
        key = run_key_issue(run_id=run.pk)
        outbox.enqueue_on_commit(queues.RUN_LOADTEST, host_name=home.host.name, args=[run.pk, key])
    return run


def _checked(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The workload checked for the model's kind, its refusals named as the API's
    own are (``workload.levels``), so a form shows each beside its field."""
    try:
        return workloads.check(kind, spec)
    except ValidationFailed as failed:
        raise failed.under("workload", keep=("model",)) from None


def native_refusal(host: GpuHost, placement: DeploymentModel) -> str:
    """Why trtllm-bench cannot measure ``placement``'s engine on ``host`` ('' if
    it can): it measures TensorRT-LLM engines, with the host's own TensorRT-LLM
    (GANTRY_TRTLLM_PYTHON), at the version that built the engine (an engine
    runs only there), and only releases whose trtllm-bench reports JSON."""
    build = placement.engine_build
    if build is None:
        return (
            f"{placement.triton_name} is served by {placement.backend}, not from a TensorRT-LLM engine build: "
            "trtllm-bench measures engines"
        )
    if build.host_id != host.pk:
        return f"engine build {build.pk} is on another host than {host.name}"
    release = trtllm.release_for(build.trtllm_version)
    if release is None:
        return f"TensorRT-LLM {build.trtllm_version or '(unknown)'} of engine build {build.pk} is not in Gantry's table"
    refusal = trtllm.bench_refusal(release)
    if refusal:
        return refusal
    installed = (host.builders or {}).get("native", "")
    if installed != build.trtllm_version:
        has = f"TensorRT-LLM {installed}" if installed else "no TensorRT-LLM (set GANTRY_TRTLLM_PYTHON there)"
        return (
            f"trtllm-bench runs with the host's own TensorRT-LLM: {host.name} has {has}, and engine build "
            f"{build.pk} was built with {build.trtllm_version} (an engine runs only with its own version)"
        )
    return ""


def _describe(workload: dict[str, Any]) -> str:
    levels = ", ".join(f"{level:g}" for level in workload["levels"])
    bound = f"{workload['duration_s']} s" if workload["duration_s"] else f"{workload['request_count']} requests"
    return f"{workload['mode']} {levels}, {bound} each"


def context_of(deployment: Deployment, host: GpuHost, triton_name: str) -> dict[str, Any]:
    """What a run measures against, as it is now: the deployment's generation,
    runtime, image and replicas, every model placed beside the one under test
    (each with its engine build), the run's host's GPUs and driver, and
    Gantry's version."""
    placements = []
    for p in deployment.placements.select_related("registered_model", "engine_build").order_by("triton_name"):
        build = p.engine_build
        placements.append(
            {
                "triton_name": p.triton_name,
                "under_test": p.triton_name == triton_name,
                "model": p.registered_model.name,
                "kind": p.registered_model.kind,
                "fingerprint": p.registered_model.fingerprint,
                "untrained": bool(p.registered_model.notice),
                "backend": p.backend,
                "max_batch_size": p.max_batch_size,
                "preferred_batch_sizes": p.preferred_batch_sizes,
                "max_queue_delay_us": p.max_queue_delay_us,
                "instance_count": p.instance_count,
                "instance_kind": p.instance_kind,
                "gpu_ids": p.gpu_ids,
                "gpu_memory_fraction": p.gpu_memory_fraction,
                "batch_scheduler_policy": p.batch_scheduler_policy,
                "kv_cache_tokens": p.kv_cache_tokens,
                "build": None
                if build is None
                else {
                    "id": build.pk,
                    "cache_key": build.cache_key,
                    "spec": build.spec,
                    "trtllm_version": build.trtllm_version,
                    "builder_image": build.builder_image,
                    "image_digest": build.image_digest,
                    "gpu_name": build.gpu_name,
                },
            }
        )
    return {
        "deployment": {
            "id": deployment.pk,
            "name": deployment.name,
            "generation": deployment.generation,
            "runtime": deployment.runtime,
            "image": deployment.image,
            "replicas": deployment.replicas,
        },
        "host": {
            "name": host.name,
            "driver_version": host.driver_version,
            "cuda_version": host.cuda_version,
            "gpus": [
                {"index": g.index, "name": g.name, "uuid": g.uuid, "memory_total_bytes": g.memory_total_bytes}
                for g in host.gpus.order_by("index")
            ],
        },
        "placements": placements,
        "gantry_version": gantry_version(),
    }


def run_cancel(*, run_id: int, user: Any = None) -> LoadTest:
    """A queued run is cancelled at once; a running one is asked to stop (its
    worker stops the load generator and keeps the steps it finished)."""
    return runs.cancel(LOAD_TEST, run_id=run_id, user=user)


def run_delete(*, run_id: int, user: Any = None) -> None:
    """Forget a finished run and its figures (refused while it is active)."""
    runs.delete(LOAD_TEST, run_id=run_id, user=user)


# --- the worker's writes ------------------------------------------------------


def run_claim(*, run_id: int, source: str) -> LoadTest | None:
    """The worker takes a queued run (None when it is no longer queued)."""
    return runs.claim(LOAD_TEST, run_id=run_id, source=source, message="load generator starting")


def run_report(*, run_id: int, progress: dict[str, Any], log_tail: str | None = None) -> str:
    """The worker's heartbeat: the step under way, the generator's last lines;
    returns the run's status now (cancelling means stop)."""
    fields = {} if log_tail is None else {"log_tail": log_tail}
    return runs.report(LOAD_TEST, run_id=run_id, progress=progress, **fields)


def run_key_issue(*, run_id: int) -> str:
    """The run's gateway key, scoped to its alias (loadtests.runs.key_issue)."""
    return runs.key_issue(LOAD_TEST, run_id=run_id)


def run_note_load_generator(*, run_id: int, name: str, version: str) -> None:
    """Record which load generator (and version) the worker runs."""
    run = LoadTest.objects.get(pk=run_id)
    run.context = {**run.context, "load_generator": {"name": name, "version": version}}
    run.save(update_fields=["context"])


def point_save(
    *,
    run_id: int,
    target: str,
    level: float,
    complete: bool,
    summary: dict[str, Any],
    records: list[dict[str, Any]],
    server: dict[str, Any],
    started_at: dt.datetime,
    finished_at: dt.datetime,
) -> LoadPoint:
    """Keep one step's figures (a step run again replaces its earlier figures)."""
    point, _ = LoadPoint.objects.update_or_create(
        run_id=run_id,
        target=target,
        level=level,
        defaults={
            "complete": complete,
            "summary": summary,
            "records": records,
            "server": server,
            "started_at": started_at,
            "finished_at": finished_at,
        },
    )
    return point


def run_finish(*, run_id: int, status: str, message: str, source: str) -> LoadTest | None:
    """End a run as succeeded, failed or cancelled (from queued, running or
    cancelling); None when it had already ended."""
    run = LoadTest.objects.filter(pk=run_id).first()
    if run is None or run.status not in ACTIVE:
        return None
    if status == RunStatus.SUCCEEDED and run.status == RunStatus.CANCELLING:
        status = RunStatus.CANCELLED  # it finished as the cancel arrived
    try:
        ended = run_transition(run_id=run_id, to=status, source=source, message=message)
    except InvalidTransition:
        return None
    if run.started_at is not None:
        metrics.observe(metrics.LOADTEST_DURATION, (timezone.now() - run.started_at).total_seconds(), status)
    return ended


def runs_reap(*, stale_after_s: int = runs.STALE_AFTER_S) -> int:
    """Fail runs whose worker stopped reporting (killed, or its host went away):
    the steps they finished are kept. Returns how many were failed."""
    return runs.reap(LOAD_TEST, run_finish, stale_after_s=stale_after_s)
