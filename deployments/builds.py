"""Engine builds: the build spec and its validation, the build cache, and every
write to an EngineBuild row (services, as in deployments.services).

A build's status moves only through ``build_transition`` (a compare-and-swap
update against ``ALLOWED``). The worker that runs the build claims it with
``build_claim``; a task delivered twice finds the row no longer pending and
does nothing, so one request never compiles twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.celery import app as celery_app
from deployments import events, trtllm
from deployments.errors import InvalidTransition, NotFound, ValidationFailed
from deployments.models import (
    BuildExecutor,
    BuildLogLine,
    BuildStatus,
    EngineBuild,
    GpuHost,
    Inspection,
    ModelKind,
    RegisteredModel,
)
from deployments.permissions import require_operator
from deployments.services import append_newest_lines

log = logging.getLogger(__name__)
B = BuildStatus

ALLOWED: dict[str, frozenset[str]] = {
    B.PENDING: frozenset({B.RUNNING, B.CANCELLED, B.FAILED}),
    B.RUNNING: frozenset({B.CANCELLING, B.SUCCEEDED, B.FAILED}),
    B.CANCELLING: frozenset({B.CANCELLED, B.FAILED}),
}
TERMINAL = frozenset({B.SUCCEEDED, B.FAILED, B.CANCELLED})
ACTIVE = frozenset({B.PENDING, B.RUNNING, B.CANCELLING})
MIN_TIME_LIMIT_S = 10
NATIVE = "native"  # the builder "image" that means tensorrt_llm installed on the host itself

DEFAULTS: dict[str, Any] = {
    "dtype": "float16",
    "quantization": "none",
    "gemm_plugin": "auto",
    "gpt_attention_plugin": "auto",
    "context_fmha": True,
    "paged_context_fmha": True,
    "remove_input_padding": True,
    "max_batch_size": 8,
    "max_input_len": 1024,
    "max_seq_len": 2048,
    "max_num_tokens": 8192,
    "max_beam_width": 1,
    "tp_size": 1,
    "pp_size": 1,
    "workers": 1,
    "gpu_ids": [],
    "allow_seq_len_over_max_positions": False,
}


def _cc(value: str) -> tuple[int, int]:
    major, _, minor = value.partition(".")
    return int(major or 0), int(minor or 0)


# --- the spec ----------------------------------------------------------------


def builder_choices(host: GpuHost) -> dict[str, str]:
    """Builder images usable on ``host`` -> their TensorRT-LLM version: allow-listed
    and present there (the agent reports their digests), plus ``native`` where the
    host has tensorrt_llm installed."""
    present = (host.builders or {}).get("images", {})
    choices = {image: version for image, version in settings.GANTRY_BUILDER_IMAGES.items() if image in present}
    native = (host.builders or {}).get("native", "")
    if native:
        choices[NATIVE] = native
    return choices


def image_digest(host: GpuHost, image: str) -> str:
    if image == NATIVE:
        return f"native:tensorrt_llm-{(host.builders or {}).get('native', '')}"
    return (host.builders or {}).get("images", {}).get(image, "")


def normalize_spec(raw: dict[str, Any], *, model: RegisteredModel, host: GpuHost, image: str) -> dict[str, Any]:
    """The full build spec with defaults filled in, or ValidationFailed naming
    each field and the rule it broke. Types and ranges are the serializer's job;
    here are the rules that need the checkpoint, the host and the release."""
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        raise ValidationFailed({name: "is not a build setting" for name in unknown})
    spec = {**DEFAULTS, **raw}
    errors: dict[str, list[str]] = {}

    def fail(name: str, message: str) -> None:
        errors.setdefault(name, []).append(message)

    if model.kind != ModelKind.LLM:
        fail("model", f"{model.name} is a {model.kind} model; engines are built from llm checkpoints")
    if model.inspection != Inspection.READY:
        fail(
            "model", f"{model.name} is not inspected yet ({model.inspection}): {model.inspection_message}".rstrip(": ")
        )

    choices = builder_choices(host)
    release = None
    if image not in choices:
        if image != NATIVE and image not in settings.GANTRY_BUILDER_IMAGES:
            allowed = ", ".join(sorted(settings.GANTRY_BUILDER_IMAGES)) or "none configured"
            fail("image", f"{image!r} is not an allow-listed builder image (GANTRY_BUILDER_IMAGES: {allowed})")
        elif image == NATIVE:
            fail("image", f"{host.name} has no tensorrt_llm installed for native builds")
        else:
            fail("image", f"{image} is not on {host.name}: pull it there first (its agent reports the images it has)")
    else:
        release = trtllm.release_for(choices[image])
        if release is None:
            known = ", ".join(trtllm.RELEASES)
            fail("image", f"TensorRT-LLM {choices[image]} of {image} is not in Gantry's version table ({known})")

    if release is not None and model.architecture not in release.model_dirs:
        supported = ", ".join(release.architectures)
        fail("model", f"architecture {model.architecture or '(none)'} is not supported; supported: {supported}")

    if spec["dtype"] not in trtllm.DTYPES:
        fail("dtype", f"must be one of {', '.join(trtllm.DTYPES)}")
    if spec["quantization"] not in trtllm.QUANTIZATIONS:
        fail("quantization", f"must be one of {', '.join(trtllm.QUANTIZATIONS)}")
    for plugin in ("gemm_plugin", "gpt_attention_plugin"):
        if spec[plugin] not in trtllm.PLUGIN_CHOICES:
            fail(plugin, f"must be one of {', '.join(trtllm.PLUGIN_CHOICES)}")
    if spec["paged_context_fmha"] and (not spec["context_fmha"] or spec["gpt_attention_plugin"] == "disable"):
        fail("paged_context_fmha", "needs context_fmha and the gpt_attention_plugin")

    if spec["max_seq_len"] < spec["max_input_len"]:
        fail("max_seq_len", f"must be at least max_input_len ({spec['max_input_len']})")
    limit = model.max_position_embeddings
    if limit and spec["max_seq_len"] > limit and not spec["allow_seq_len_over_max_positions"]:
        fail(
            "max_seq_len",
            f"exceeds the checkpoint's max_position_embeddings ({limit}); "
            "set allow_seq_len_over_max_positions to build it anyway",
        )
    if not spec["paged_context_fmha"] and spec["max_num_tokens"] < spec["max_input_len"]:
        fail("max_num_tokens", "must be at least max_input_len unless paged_context_fmha chunks the context")

    world = spec["tp_size"] * spec["pp_size"]
    heads = model.num_attention_heads
    if heads and heads % spec["tp_size"]:
        fail("tp_size", f"must divide the checkpoint's {heads} attention heads")
    if model.num_layers and spec["pp_size"] > model.num_layers:
        fail("pp_size", f"cannot exceed the checkpoint's {model.num_layers} layers")
    if spec["workers"] > world:
        fail("workers", f"must be at most tp_size * pp_size ({world})")

    gpus = {gpu.index: gpu for gpu in host.gpus.all()}
    gpu_ids = sorted(spec["gpu_ids"]) or sorted(gpus)[:world]
    if world > len(gpus):
        fail("tp_size", f"tp_size * pp_size = {world} GPUs, but {host.name} has {len(gpus)}")
    elif spec["gpu_ids"]:
        missing = [i for i in gpu_ids if i not in gpus]
        if missing:
            fail("gpu_ids", f"{host.name} has no GPU {', '.join(map(str, missing))}")
        elif len(set(gpu_ids)) != world:
            fail("gpu_ids", f"must name exactly tp_size * pp_size = {world} distinct GPUs")
    chosen = [gpus[i] for i in gpu_ids if i in gpus]
    if len({(g.name, g.compute_capability) for g in chosen}) > 1:
        fail("gpu_ids", "the build's GPUs must all be the same model")
    if chosen:
        cc = _cc(chosen[0].compute_capability)
        for name, choice in (("dtype", spec["dtype"]), ("quantization", spec["quantization"])):
            need = trtllm.MIN_COMPUTE_CAPABILITY.get(choice)
            if need and cc < need:
                fail(
                    name,
                    f"{choice} needs compute capability {need[0]}.{need[1]} or higher; "
                    f"{chosen[0].name} has {chosen[0].compute_capability}",
                )
    if errors:
        raise ValidationFailed(errors)
    spec["gpu_ids"] = gpu_ids
    spec["trtllm_version"] = release.version
    spec["gpu_name"] = chosen[0].name
    spec["compute_capability"] = chosen[0].compute_capability
    return spec


def cache_key(*, fingerprint: str, spec: dict[str, Any], image_digest: str) -> str:
    """Equal keys mean equal engines: same checkpoint content, spec, image and GPU model."""
    # Which GPUs of the same model ran it does not change the engine.
    material = {
        "fingerprint": fingerprint,
        "spec": {k: v for k, v in spec.items() if k != "gpu_ids"},
        "image_digest": image_digest,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


# --- requests and cancellation ------------------------------------------------


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
    registered = RegisteredModel.objects.select_related("host").filter(name=model).first()
    if registered is None:
        raise ValidationFailed({"model": f"no registered model named {model!r}"})
    target = GpuHost.objects.prefetch_related("gpus").filter(name=host).first()
    if target is None:
        raise ValidationFailed({"host": f"no GPU host named {host!r}"})
    limit = time_limit_s or settings.GANTRY_BUILD_TIME_LIMIT
    if not MIN_TIME_LIMIT_S <= limit <= settings.GANTRY_BUILD_TIME_LIMIT_MAX:
        raise ValidationFailed(
            {"time_limit_s": f"must be between {MIN_TIME_LIMIT_S} and {settings.GANTRY_BUILD_TIME_LIMIT_MAX}"}
        )
    normalized = normalize_spec(spec, model=registered, host=target, image=image)
    digest = image_digest(target, image)
    key = cache_key(fingerprint=registered.fingerprint, spec=normalized, image_digest=digest)

    if not force:
        done = EngineBuild.objects.filter(cache_key=key, status=B.SUCCEEDED).order_by("-finished_at").first()
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
                executor=BuildExecutor.NATIVE if image == NATIVE else BuildExecutor.DOCKER,
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
            queue = target.queue
            transaction.on_commit(lambda: celery_app.send_task("workers.tasks.run_build", args=[build.pk], queue=queue))
    except IntegrityError:
        # The same build was requested at the same moment: one row won the unique index.
        running = EngineBuild.objects.filter(cache_key=key, status__in=ACTIVE).first()
        if running is None:  # it finished in between; ask again
            raise ValidationFailed({"model": "an identical build just finished; request it again"}) from None
        return running, "joined"
    return build, "queued"


def build_cancel(*, build_id: int, user: Any = None) -> EngineBuild:
    """A pending build is cancelled at once; a running one is asked to stop (its
    worker kills the container or process and records it cancelled)."""
    require_operator(user)
    build = _get(build_id)
    source = events.source_of(user)
    if build.status == B.PENDING:
        return build_transition(
            build_id=build_id, to=B.CANCELLED, source=source, actor=user, message="cancelled before it started"
        )
    if build.status == B.RUNNING:
        return build_transition(
            build_id=build_id, to=B.CANCELLING, source=source, actor=user, message="cancel requested"
        )
    raise InvalidTransition(f"build {build_id} is {build.status}; only pending or running builds can be cancelled")


# --- the worker's writes ------------------------------------------------------


def _get(build_id: int) -> EngineBuild:
    build = EngineBuild.objects.select_related("model", "host").filter(pk=build_id).first()
    if build is None:
        raise NotFound(f"build {build_id} does not exist")
    return build


def build_transition(
    *, build_id: int, to: str, source: str, message: str = "", actor: Any = None, **fields: Any
) -> EngineBuild:
    """Move a build to ``to`` if ``ALLOWED`` permits it from its current status
    (compare-and-swap), with ``fields`` written in the same update."""
    with transaction.atomic():
        current = EngineBuild.objects.filter(pk=build_id).values_list("status", flat=True).first()
        if current is None:
            raise NotFound(f"build {build_id} does not exist")
        if to not in ALLOWED.get(current, frozenset()):
            raise InvalidTransition(f"build {build_id} cannot go from {current} to {to}")
        now = timezone.now()
        update = {"status": to, "status_message": message, "heartbeat_at": now, **fields}
        if to in TERMINAL:
            update["finished_at"] = now
        if not EngineBuild.objects.filter(pk=build_id, status=current).update(**update):
            raise InvalidTransition(f"build {build_id} changed while moving to {to}")
        build = _get(build_id)
        events.record(
            kind="build.status",
            source=source,
            actor=actor,
            build=build,
            model=build.model,
            from_status=current,
            to_status=to,
            message=message,
            data={k: v for k, v in fields.items() if k in ("phase", "exit_code", "hint")},
        )
    return build


def build_claim(*, build_id: int, source: str, output_dir: str) -> EngineBuild | None:
    """The worker takes a pending build; None when it is not pending any more
    (cancelled, or claimed by an earlier delivery of the same task)."""
    try:
        return build_transition(
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
        return build_transition(build_id=build_id, to=to, source=source, message=message, **fields)
    except InvalidTransition:
        return None


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
