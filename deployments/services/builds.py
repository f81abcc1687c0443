"""Engine builds as people and workers ask for them: request (or reuse) a build,
cancel it, and the worker's writes while it runs (claim, progress, log, finish),
plus the reaper for builds whose worker went quiet.

A build's status moves only through deployments.states.build_transition. The
worker claims a pending build with ``build_claim``; a task delivered twice
finds the row no longer pending and does nothing, so one request never
compiles twice.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, NamedTuple

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from common import metrics
from common.errors import InvalidTransition, NotFound, ValidationFailed
from core import events, queues
from core.permissions import require_operator
from deployments import build_spec, selectors, states
from deployments.models import BuildExecutor, BuildLogLine, EngineBuild, RegisteredModel
from deployments.models import BuildStatus as B
from deployments.services.telemetry import append_newest_lines
from hosts import outbox
from hosts.models import GpuHost


class _Checked(NamedTuple):
    model: RegisteredModel
    host: GpuHost
    time_limit_s: int
    spec: dict[str, Any]
    image_digest: str
    cache_key: str


def _resolve(*, model: str, host: str, image: str, spec: dict[str, Any], time_limit_s: int | None) -> _Checked:
    """A build request checked: the model, the host, the time limit, the normalized
    spec, the image digest and the cache key; ValidationFailed names what is wrong."""
    registered = RegisteredModel.objects.select_related("host").filter(name=model).first()
    if registered is None:
        raise ValidationFailed({"model": f"no registered model named {model!r}"})
    target = GpuHost.objects.prefetch_related("gpus").filter(name=host).first()
    if target is None:
        raise ValidationFailed({"host": f"no GPU host named {host!r}"})
    limit = time_limit_s or settings.GANTRY_BUILD_TIME_LIMIT
    low, high = build_spec.MIN_TIME_LIMIT_S, settings.GANTRY_BUILD_TIME_LIMIT_MAX
    if not low <= limit <= high:
        raise ValidationFailed({"time_limit_s": f"must be between {low} and {high}"})
    try:
        normalized = build_spec.normalize_spec(spec, model=registered, host=target, image=image)
    except ValidationFailed as failed:
        # The spec's own rules under spec., as the API names its type errors.
        raise failed.under("spec", keep=("model", "image")) from None
    digest = build_spec.image_digest(target, image)
    key = build_spec.cache_key(fingerprint=registered.fingerprint, spec=normalized, image_digest=digest)
    return _Checked(registered, target, limit, normalized, digest, key)


def _succeeded(key: str) -> EngineBuild | None:
    reusable = EngineBuild.objects.filter(cache_key=key, status=B.SUCCEEDED, files_missing="")
    return reusable.order_by("-finished_at").first()


def _running(key: str) -> EngineBuild | None:
    return EngineBuild.objects.filter(cache_key=key, status__in=states.BUILD_ACTIVE).first()


def build_preflight(
    *,
    model: str,
    host: str,
    image: str,
    spec: dict[str, Any],
    time_limit_s: int | None = None,
    force: bool = False,
    user: Any = None,
) -> dict[str, Any]:
    """What build_request would say, with nothing written: every broken rule by
    field, or the normalized spec, its cache key, and the build an identical
    request would be answered with (``reuse``: "cached" or "joined"; none when
    it would compile)."""
    require_operator(user)
    try:
        checked = _resolve(model=model, host=host, image=image, spec=spec, time_limit_s=time_limit_s)
    except ValidationFailed as exc:
        return {"valid": False, "errors": exc.errors, "spec": None, "cache_key": None, "reuse": None}
    reuse = None
    if (done := None if force else _succeeded(checked.cache_key)) is not None:
        reuse = {"how": "cached", "build": done.pk}
    elif (running := _running(checked.cache_key)) is not None:
        reuse = {"how": "joined", "build": running.pk}
    return {"valid": True, "errors": {}, "spec": checked.spec, "cache_key": checked.cache_key, "reuse": reuse}


def build_request(
    *,
    model: str,
    host: str,
    image: str,
    spec: dict[str, Any],
    time_limit_s: int | None = None,
    force: bool = False,
    user: Any = None,
) -> tuple[EngineBuild, str]:
    """Validate and queue a build on ``host``; returns (build, how): "queued", or
    "cached" (an identical succeeded build, unless ``force``), or "joined" (an
    identical build already under way)."""
    require_operator(user)
    registered, target, limit, normalized, digest, key = _resolve(
        model=model, host=host, image=image, spec=spec, time_limit_s=time_limit_s
    )
    if not force:
        done = _succeeded(key)
        if done is not None:
            events.record(
                kind="build.reused",
                source=events.source_of(user),
                actor=user,
                build=done,
                model=registered,
                message=f"an identical request reused build {done.pk} instead of compiling again",
            )
            return done, "cached"
    try:
        with transaction.atomic():
            build = EngineBuild.objects.create(
                model=registered,
                host=target,
                spec=normalized,
                executor=BuildExecutor.NATIVE if image == build_spec.NATIVE else BuildExecutor.DOCKER,
                builder_image=image,
                image_digest=digest,
                trtllm_version=normalized["trtllm_version"],
                gpu_name=normalized["gpu_name"],
                compute_capability=normalized["compute_capability"],
                gpu_ids=normalized["gpu_ids"],
                tp_size=normalized["tp_size"],
                pp_size=normalized["pp_size"],
                cache_key=key,
                forced=force,
                time_limit_s=limit,
                created_by=events.signed_in(user),
            )
            events.record(
                kind="build.requested",
                source=events.source_of(user),
                actor=user,
                build=build,
                model=registered,
                host=target,
                to_status=B.PENDING,
                message=f"build of {registered.name} on {target.name} with {image} "
                f"(TensorRT-LLM {build.trtllm_version}, {build.gpu_name}, tp {build.tp_size} x pp {build.pp_size})",
                data={"spec": normalized, "force": force},
            )
            outbox.enqueue_on_commit(queues.RUN_BUILD, host_name=target.name, args=[build.pk])
    except IntegrityError:
        # The same build was requested at the same moment: one row won the unique index.
        running = _running(key)
        if running is None:  # it finished in between; ask again
            raise ValidationFailed({"model": "an identical build just finished; request it again"}) from None
        return running, "joined"
    return build, "queued"


def build_cancel(*, build_id: int, user: Any = None) -> EngineBuild:
    """A pending build is cancelled at once; a running one is asked to stop (its
    worker kills the container or process and records it cancelled)."""
    require_operator(user)
    build = selectors.build_get(build_id)
    source = events.source_of(user)
    if build.status == B.PENDING:
        return states.build_transition(
            build_id=build_id, to=B.CANCELLED, source=source, actor=user, message="cancelled before it started"
        )
    if build.status == B.RUNNING:
        return states.build_transition(
            build_id=build_id, to=B.CANCELLING, source=source, actor=user, message="cancel requested"
        )
    raise InvalidTransition(f"build {build_id} is {build.status}; only pending or running builds can be cancelled")


# --- the worker's writes ------------------------------------------------------


def build_delete(*, build_id: int, user: Any = None) -> None:
    """Delete a finished build and, on its host, its engine files. Refused while
    it is pending or running (cancel it) or while a deployment uses it."""
    require_operator(user)
    with transaction.atomic():
        build = EngineBuild.objects.select_related("host", "model").select_for_update().filter(pk=build_id).first()
        if build is None:
            raise NotFound(f"build {build_id} does not exist")
        if build.status not in states.BUILD_TERMINAL:
            raise InvalidTransition(f"build {build_id} is {build.status}; cancel it before deleting it")
        users = sorted(build.placements.values_list("deployment__name", flat=True).distinct())
        if users:
            raise InvalidTransition(f"build {build_id} is deployed in {', '.join(users)}; change them first")
        events.record(
            kind="build.deleted",
            source=events.source_of(user),
            actor=user,
            host=build.host,
            message=f"build {build_id} of {build.model.name} deleted; its engine files are removed from "
            f"{build.host.name}",
            data={"build": build_id, "model": build.model.name, "cache_key": build.cache_key},
        )
        outbox.enqueue_on_commit(queues.FORGET_BUILD, host_name=build.host.name, args=[build_id])
        build.delete()


def build_claim(*, build_id: int, source: str, output_dir: str) -> EngineBuild | None:
    """The worker takes a pending build; None when it is not pending any more
    (cancelled, or claimed by an earlier delivery of the same task)."""
    try:
        return states.build_transition(
            build_id=build_id,
            to=B.RUNNING,
            source=source,
            message="started",
            started_at=timezone.now(),
            phase="preparing the checkpoint",
            output_dir=output_dir,
        )
    except InvalidTransition:
        return None


def build_progress(*, build_id: int, source: str, phase: str | None = None, runtime_handle: str | None = None) -> str:
    """Heartbeat a running build (and record a new phase); returns its status, so
    the worker notices a cancel request."""
    fields: dict[str, Any] = {"heartbeat_at": timezone.now()}
    if runtime_handle is not None:
        fields["runtime_handle"] = runtime_handle
    with transaction.atomic():
        build = EngineBuild.objects.select_for_update().select_related("model").get(pk=build_id)
        if phase and phase != build.phase:
            fields["phase"] = phase
            events.record(kind="build.phase", source=source, build=build, model=build.model, message=phase)
        EngineBuild.objects.filter(pk=build_id).update(**fields)
    events.publish(
        events.build_group(build_id),
        {"type": "build", "build": build_id, "phase": phase or build.phase, "status": build.status},
    )
    return build.status


def build_log_append(*, build_id: int, lines: list[str]) -> None:
    """Store one batch of build output (one insert), keep the newest
    GANTRY_BUILD_LOG_LINES, and push the batch to the build's sockets."""
    if not lines:
        return
    append_newest_lines(BuildLogLine, keep=settings.GANTRY_BUILD_LOG_LINES, lines=lines, build_id=build_id)
    events.publish(events.build_group(build_id), {"type": "log", "build": build_id, "lines": lines})


def build_finish(*, build_id: int, to: str, source: str, message: str, **fields: Any) -> EngineBuild | None:
    """End a build (succeeded, failed or cancelled); a cancel request turns any
    end but success into cancelled. None if it had already ended."""
    current = EngineBuild.objects.filter(pk=build_id).values_list("status", flat=True).first()
    if current == B.CANCELLING and to == B.FAILED:
        to, message = B.CANCELLED, "cancelled"
    if current == B.CANCELLING and to == B.SUCCEEDED:
        to, message = B.CANCELLED, "cancelled (the engine it finished is kept on disk but not recorded)"
        fields = {}
    try:
        build = states.build_transition(build_id=build_id, to=to, source=source, message=message, **fields)
    except InvalidTransition:
        return None
    if build.started_at is not None:
        metrics.observe(metrics.BUILD_DURATION, (timezone.now() - build.started_at).total_seconds(), to)
    return build


def build_files_missing(*, build_id: int, problem: str, source: str) -> bool:
    """Record that a succeeded build's engine folder is gone or changed on its host
    (``problem`` says what): it is never reused or served again, and an identical
    request compiles anew. False when that was already known."""
    with transaction.atomic():
        changed = EngineBuild.objects.filter(pk=build_id, status=B.SUCCEEDED, files_missing="").update(
            files_missing=problem[:512]
        )
        if changed:
            build = EngineBuild.objects.select_related("host", "model").get(pk=build_id)
            events.record(
                kind="build.files_missing",
                source=source,
                build=build,
                model=build.model,
                host=build.host,
                message=f"build {build_id}'s engine on {build.host.name}: {problem}; it is no longer reused "
                "or served, and an identical request builds it again",
            )
    return bool(changed)


def build_redrive(*, build_id: int, source: str, message: str) -> bool:
    """Send a pending build's run task again (its first may have been lost inside
    a broker that restarted); False when the build is no longer pending or a
    task still waits in the outbox. A duplicate is harmless: only one claims it."""
    with transaction.atomic():
        build = EngineBuild.objects.select_related("host").select_for_update(of=("self",)).filter(pk=build_id).first()
        if build is None or build.status != B.PENDING:
            return False
        return outbox.redrive(
            queues.RUN_BUILD, host_name=build.host.name, args=[build.pk], source=source, message=message, build=build
        )


def _builds_resend(host_name: str, source: str, message: str) -> list[str]:
    pending = EngineBuild.objects.filter(host__name=host_name, status=B.PENDING).values_list("pk", flat=True)
    return [f"build {pk}" for pk in pending if build_redrive(build_id=pk, source=source, message=message)]


outbox.register(
    outbox.HostTask(
        queues.RUN_BUILD,
        about=lambda pk: {"build": found} if (found := EngineBuild.objects.filter(pk=pk).first()) else {},
        resend_waiting=_builds_resend,
    )
)


def builds_reap() -> list[int]:
    """Fail builds whose worker stopped heartbeating them (its host died), so
    nothing stays running forever. Returns the ids it failed."""
    cutoff = timezone.now() - timedelta(seconds=settings.GANTRY_BUILD_STALE_AFTER)
    stale = list(
        EngineBuild.objects.filter(status__in=[B.RUNNING, B.CANCELLING], heartbeat_at__lt=cutoff).values_list(
            "pk", flat=True
        )
    )
    reaped = []
    for build_id in stale:
        ended = build_finish(
            build_id=build_id,
            to=B.FAILED,
            source="system",
            message=f"its worker stopped reporting for {settings.GANTRY_BUILD_STALE_AFTER} s; request the build again",
        )
        if ended is not None:
            reaped.append(build_id)
    return reaped
