"""Load tests as people and workers ask for them: start one (checked, one at a
time per deployment, confirmed when real clients use the deployment), cancel
it, the worker's writes while it runs (claim, its gateway key, progress, each
step's figures, finish), and the reaper for runs whose worker went quiet.

A run's status moves only through ``run_transition`` (a job kind of
deployments.jobs; the table is loadtests.models.ALLOWED); each move is on the
deployment's timeline, and a run that ends takes its gateway key with it.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from common import metrics
from common.errors import ConfirmationRequired, InvalidTransition, NotFound, ValidationFailed
from common.version import gantry_version
from deployments import events, jobs, outbox, queues, trtllm
from deployments.models import Deployment, DeploymentModel, DeploymentStatus, GpuHost
from deployments.permissions import require_operator
from gateway import services as gateway_services
from gateway.models import Alias, ApiKey
from loadtests import workload as workloads
from loadtests.models import ACTIVE, ALLOWED, TERMINAL, LoadPoint, LoadTest, RunStatus, TuningRun

# The gateway keys a run makes for itself are named so; they are not "real clients".
KEY_NAME_PREFIX = "load test "
TUNING_KEY_NAME = KEY_NAME_PREFIX + "(tuning run {})"
# How long a run's key may live: it is revoked as soon as its run ends; this
# bounds a key whose run waits long behind other jobs, or never ends.
KEY_VALID_S = 2 * 24 * 3600
# A running run whose worker has not reported for this long is failed by the reaper.
STALE_AFTER_S = 120


def _lock_deployment(run_id: int) -> None:
    # The deployment's row first, as run_create locks them: a move takes the run
    # out of (or into) the one-active-run index, which a concurrent create waits
    # on while holding the deployment; the other order deadlocks.
    deployment_id = LoadTest.objects.filter(pk=run_id).values_list("deployment_id", flat=True).first()
    Deployment.objects.select_for_update().filter(pk=deployment_id).first()


def _run_moved(move: jobs.Move) -> LoadTest:
    run = LoadTest.objects.select_related("deployment").get(pk=move.job_id)
    events.record(
        kind=f"loadtest.{move.to}",
        source=move.source,
        actor=move.actor,
        deployment=run.deployment,
        from_status=move.previous,
        to_status=move.to,
        message=move.message or f"load test {run.pk} of {run.alias} is {move.to}",
        data={"load_test": run.pk, "alias": run.alias},
    )
    transaction.on_commit(lambda: _publish(run))
    return run


def _run_stamps(to: str, now: dt.datetime) -> dict[str, Any]:
    return {"started_at": now, "heartbeat_at": now} if to == RunStatus.RUNNING else {}


LOAD_TEST = jobs.register(
    jobs.JobKind(
        name="load test",
        model=LoadTest,
        allowed=ALLOWED,
        terminal=TERMINAL,
        after=_run_moved,
        stamps=_run_stamps,
        lock_first=_lock_deployment,
    )
)


def run_transition(*, run_id: int, to: str, source: str, message: str = "", actor: Any = None) -> LoadTest:
    """Move run ``run_id`` to ``to`` if the table allows it from where it is (a
    compare-and-swap, deployments.jobs), and put it on its deployment's timeline."""
    return jobs.job_transition(LOAD_TEST, job_id=run_id, to=to, source=source, message=message, actor=actor)


def _publish(run: LoadTest) -> None:
    if run.deployment_id is not None:
        events.publish(events.deployment_group(run.deployment_id), run_payload(run))


def run_payload(run: LoadTest) -> dict[str, Any]:
    """What a page is told when a run moves or reports progress."""
    return {
        "type": "loadtest",
        "id": run.pk,
        "status": run.status,
        "status_message": run.status_message,
        "progress": run.progress,
    }


def production_keys(alias: Alias) -> list[ApiKey]:
    """The live gateway keys, other than load tests' own, that may use ``alias``."""
    now = timezone.now()
    return list(
        ApiKey.objects.filter(revoked_at__isnull=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .filter(Q(all_aliases=True) | Q(aliases=alias))
        .exclude(name__startswith=KEY_NAME_PREFIX)
        .distinct()
        .order_by("name")
    )


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
        keys = production_keys(target)
        if keys and not confirm:
            names = ", ".join(key.name for key in keys[:5]) + (" ..." if len(keys) > 5 else "")
            raise ConfirmationRequired(
                f"{len(keys)} live gateway key(s) may use {alias} ({names}): their requests will slow "
                "while this runs; send confirm: true to go ahead"
            )
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


def run_redrive(*, run_id: int, source: str, message: str) -> bool:
    """Send a queued run's task again (its first may have been lost inside a broker
    that restarted); False when the run is no longer queued or a task still waits
    in the outbox. A duplicate is harmless: only one worker claims the run."""
    with transaction.atomic():
        run = LoadTest.objects.select_related("deployment", "host").select_for_update(of=("self",)).filter(pk=run_id)
        run = run.first()
        if run is None or run.status != RunStatus.QUEUED or run.host is None:
            return False
        if outbox.is_waiting(queues.RUN_LOADTEST, run.pk):  # before a new key revokes the waiting task's
            return False
        return outbox.redrive(
            queues.RUN_LOADTEST,
            host_name=run.host.name,
            args=[run.pk, *key_for_redrive(run.pk, run_key_issue)],
            source=source,
            message=f"load test {run.pk}: {message}",
            deployment=run.deployment,
        )


def _runs_resend(host_name: str, source: str, message: str) -> list[str]:
    queued = LoadTest.objects.filter(host__name=host_name, status=RunStatus.QUEUED).values_list("pk", flat=True)
    return [f"load test {pk}" for pk in queued if run_redrive(run_id=pk, source=source, message=message)]


outbox.register(outbox.HostTask(queues.RUN_LOADTEST, resend_waiting=_runs_resend))


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
    require_operator(user)
    run = LoadTest.objects.filter(pk=run_id).first()
    if run is None:
        raise NotFound(f"load test {run_id} does not exist")
    source = events.source_of(user)
    if run.status == RunStatus.QUEUED:
        return run_transition(run_id=run_id, to=RunStatus.CANCELLED, source=source, actor=user,
                              message="cancelled before it started")  # fmt: skip
    if run.status == RunStatus.RUNNING:
        return run_transition(run_id=run_id, to=RunStatus.CANCELLING, source=source, actor=user,
                              message="cancel requested")  # fmt: skip
    raise InvalidTransition(f"load test {run_id} is {run.status}; only a queued or running one can be cancelled")


def run_delete(*, run_id: int, user: Any = None) -> None:
    """Forget a finished run and its figures (refused while it is active)."""
    require_operator(user)
    with transaction.atomic():
        run = LoadTest.objects.select_for_update().filter(pk=run_id).first()
        if run is None:
            raise NotFound(f"load test {run_id} does not exist")
        if run.status in ACTIVE:
            raise InvalidTransition(f"load test {run_id} is {run.status}; cancel it before deleting it")
        run.delete()


# --- the worker's writes ------------------------------------------------------


def run_claim(*, run_id: int, source: str) -> LoadTest | None:
    """The worker takes a queued run (None when it is no longer queued: cancelled
    meanwhile, or a second delivery of the same task)."""
    try:
        return run_transition(run_id=run_id, to=RunStatus.RUNNING, source=source, message="load generator starting")
    except (InvalidTransition, NotFound):
        return None


def run_report(*, run_id: int, progress: dict[str, Any], log_tail: str | None = None) -> str:
    """The worker's heartbeat: the step under way, the generator's last lines;
    returns the run's status now (cancelling means stop)."""
    fields: dict[str, Any] = {"progress": progress, "heartbeat_at": timezone.now()}
    if log_tail is not None:
        fields["log_tail"] = log_tail
    LoadTest.objects.filter(pk=run_id).update(**fields)
    run = LoadTest.objects.get(pk=run_id)
    _publish(run)
    return run.status


def run_key_issue(*, run_id: int, valid_s: int = KEY_VALID_S) -> str:
    """A gateway key for the run's load generator, scoped to the run's alias; its
    secret, once. The control plane issues it with the run's task (a host's
    credentials may not make keys) and revokes it once the run has ended
    (``ended_run_keys_revoke``); an earlier key of the run (a task sent again) is revoked."""
    run = LoadTest.objects.select_related("created_by").get(pk=run_id)
    if run.created_by is None:
        raise InvalidTransition("the user who asked for this load test no longer exists")
    run_keys_revoke(run_id=run_id)
    return gateway_services.key_create(
        name=f"{KEY_NAME_PREFIX}{run_id}",
        user=run.created_by,
        alias_names=[run.alias],
        expires_at=timezone.now() + dt.timedelta(seconds=valid_s),
    ).secret


def key_for_redrive(run_id: int, issue: Any) -> list[str]:
    """A re-sent run's new key; none from a joined host, whose credentials may not
    make keys (its worker then fails the run, asking for it again)."""
    return [] if settings.GANTRY_JOINED_HOST else [issue(run_id=run_id)]


def run_keys_revoke(*, run_id: int) -> None:
    """Revoke the gateway keys made for load test ``run_id``."""
    for key_id in ApiKey.objects.filter(name=f"{KEY_NAME_PREFIX}{run_id}", revoked_at__isnull=True).values_list(
        "pk", flat=True
    ):
        gateway_services.key_revoke(key_id=key_id)


def ended_run_keys_revoke() -> int:
    """Revoke every key of a load test or tuning run that has ended (the beat
    runs it every heartbeat: the run's end is reported by its host, whose
    credentials may not touch keys). Returns how many were revoked."""
    revoked = 0
    live = ApiKey.objects.filter(name__startswith=KEY_NAME_PREFIX, revoked_at__isnull=True)
    for key_id, name in live.values_list("pk", "name"):
        tuning = re.fullmatch(re.escape(KEY_NAME_PREFIX) + r"\(tuning run (\d+)\)", name)
        plain = re.fullmatch(re.escape(KEY_NAME_PREFIX) + r"(\d+)", name)
        run_id = int((tuning or plain).group(1)) if (tuning or plain) else None
        model = TuningRun if tuning else LoadTest
        if run_id is None or not model.objects.filter(pk=run_id, status__in=ACTIVE).exists():
            gateway_services.key_revoke(key_id=key_id)
            revoked += 1
    return revoked


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


def runs_reap(*, stale_after_s: int = STALE_AFTER_S) -> int:
    """Fail runs whose worker stopped reporting (killed, or its host went away):
    the steps they finished are kept. Returns how many were failed."""
    cutoff = timezone.now() - dt.timedelta(seconds=stale_after_s)
    stale = LoadTest.objects.filter(status__in=[RunStatus.RUNNING, RunStatus.CANCELLING], heartbeat_at__lt=cutoff)
    failed = 0
    for run in stale:
        try:
            run_transition(
                run_id=run.pk,
                to=RunStatus.FAILED,
                source="system",
                message=f"the worker stopped reporting for over {stale_after_s} s (restarted or killed); "
                "the steps it finished are kept",
            )
            failed += 1
        except InvalidTransition:
            continue
    return failed
