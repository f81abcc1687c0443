"""Registered checkpoints: registering a folder on a host, and recording what
that host's worker found when it inspected it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from common.errors import InvalidTransition, NotFound, ValidationFailed
from common.words import a
from core import events, queues
from core.permissions import require_operator
from deployments import states
from deployments.models import CheckpointCopy, Inspection, ModelKind, RegisteredModel
from deployments.services import downloads
from hosts import outbox
from hosts.models import GpuHost
from upstream import hub
from upstream.checkpoints import CheckpointInfo, inspect_checkpoint, under_roots

# Kinds whose clients send text, so the checkpoint must carry its tokenizer.
NEEDS_TOKENIZER = frozenset({ModelKind.EMBEDDING, ModelKind.RERANKER, ModelKind.LLM})


def model_register(
    *,
    name: str,
    kind: str,
    host: str,
    path: str = "",
    hub_id: str = "",
    revision: str = "",
    allow_patterns: list[str] | None = None,
    ignore_patterns: list[str] | None = None,
    trust_remote_code: bool = False,
    user: Any = None,
) -> RegisteredModel:
    """Register a HuggingFace-format checkpoint: a folder at ``path`` on
    ``host``, or, without a path, the hub repository ``hub_id`` at ``revision``
    (its allow and ignore patterns choosing the files), which ``host`` downloads
    first (deployments.services.downloads). The row is created at once
    (inspection pending); the host inspects the files once they are there
    (workers.tasks.inspect_model), filling in what it found or why it failed."""
    require_operator(user)
    errors: dict[str, str] = {}
    if kind not in ModelKind.values:
        errors["kind"] = f"must be one of {', '.join(ModelKind.values)}"
    if RegisteredModel.objects.filter(name=name).exists():
        errors["name"] = f"a model named {name!r} is already registered"
    target = GpuHost.objects.filter(name=host).first()
    if target is None:
        errors["host"] = f"no GPU host named {host!r}"
    checkpoint = Path(path)
    if not path:
        if not hub_id:
            errors["path"] = "give a checkpoint folder, or a hub_id to download"
        elif problem := hub.check_repo_id(hub_id):
            errors["hub_id"] = problem
    elif not checkpoint.is_absolute():
        errors["path"] = "must be an absolute path"
    elif not under_roots(checkpoint, settings.GANTRY_MODEL_ROOTS):
        allowed = ", ".join(str(r) for r in settings.GANTRY_MODEL_ROOTS)
        errors["path"] = f"must be under one of the configured model roots ({allowed})"
    if (allow_patterns or ignore_patterns) and path:
        errors["allow_patterns" if allow_patterns else "ignore_patterns"] = "only for a model downloaded from the hub"
    if errors:
        raise ValidationFailed(errors)
    allow = downloads.check_patterns("allow_patterns", allow_patterns or [])
    ignore = downloads.check_patterns("ignore_patterns", ignore_patterns or [])
    try:
        with transaction.atomic():
            model = RegisteredModel.objects.create(
                name=name,
                kind=kind,
                host=target,
                path=str(checkpoint) if path else "",
                hub_id=hub_id,
                revision=revision,
                allow_patterns=allow,
                ignore_patterns=ignore,
                trust_remote_code=trust_remote_code,
                inspection=Inspection.PENDING,
                created_by=events.signed_in(user),
            )
            events.record(
                kind="model.registered",
                source=events.source_of(user),
                actor=user,
                model=model,
                host=target,
                message=f"registered {name} at {path} on {host}; the host is inspecting it"
                if path
                else f"registered {name} from the hub, {hub_id}@{revision or 'main'}; {host} downloads it first",
            )
            if path:
                outbox.enqueue_on_commit(queues.INSPECT_MODEL, host_name=target.name, args=[model.pk])
            else:
                downloads.download_start(model=model, host=target, user=user, why="its first download")
    except IntegrityError as exc:
        raise ValidationFailed({"name": f"a model named {name!r} is already registered"}) from exc
    return model


def model_inspection_redrive(*, model_id: int, source: str, message: str) -> bool:
    """Send a pending inspection again (see build_redrive); False when there is
    nothing to send."""
    with transaction.atomic():
        rows = RegisteredModel.objects.select_related("host").select_for_update(of=("self",))  # host may be null
        model = rows.filter(pk=model_id).first()
        if model is None or model.inspection != Inspection.PENDING:
            return False
        return outbox.redrive(
            queues.INSPECT_MODEL,
            host_name=model.host.name,
            args=[model.pk],
            source=source,
            message=message,
            model=model,
        )


def _inspections_resend(host_name: str, source: str, message: str) -> list[str]:
    pending = RegisteredModel.objects.filter(host__name=host_name, inspection=Inspection.PENDING)
    return [
        f"inspection of {name}"
        for pk, name in pending.values_list("pk", "name")
        if model_inspection_redrive(model_id=pk, source=source, message=message)
    ]


outbox.register(
    outbox.HostTask(
        queues.INSPECT_MODEL,
        about=lambda pk: {"model": found} if (found := RegisteredModel.objects.filter(pk=pk).first()) else {},
        resend_waiting=_inspections_resend,
    )
)


def model_delete(*, model_id: int, user: Any = None) -> None:
    """Forget a registered checkpoint (its files stay where they are). Refused
    while builds or deployments use it, naming them; its name is free again."""
    require_operator(user)
    with transaction.atomic():
        model = RegisteredModel.objects.select_for_update().filter(pk=model_id).first()
        if model is None:
            raise NotFound(f"model {model_id} does not exist")
        deployed = sorted(model.placements.values_list("deployment__name", flat=True).distinct())
        if deployed:
            raise InvalidTransition(f"{model.name} is deployed in {', '.join(deployed)}; change or delete them first")
        built = sorted(model.builds.values_list("pk", flat=True))
        if built:
            raise InvalidTransition(f"{model.name} has builds {', '.join(map(str, built))}; delete them first")
        events.record(
            kind="model.deleted",
            source=events.source_of(user),
            actor=user,
            host=model.host,
            message=f"model {model.name} unregistered; its checkpoint stays in {model.path}"
            if model.path
            else f"model {model.name} unregistered; its files stay in each host's hub cache",
            data={"model": model.pk, "name": model.name, "path": model.path},
        )
        model.delete()


def model_inspect(*, model_id: int, source: str) -> None:
    """Read a registered checkpoint on the host that holds it (run there by its
    worker) and record what was found, or why it could not be read. A model
    already inspected (a task delivered twice) is left as it is."""
    model = RegisteredModel.objects.filter(pk=model_id, inspection=Inspection.PENDING).first()
    if model is None:
        return
    info = inspect_checkpoint(model.folder, roots=settings.GANTRY_MODEL_ROOTS)
    if model.kind in NEEDS_TOKENIZER and not info.tokenizer_files:
        raise ValidationFailed({"path": f"{a(model.kind)} model needs its tokenizer files beside config.json"})
    own_code = (
        [f"auto_map in config.json ({', '.join(sorted(info.config['auto_map']))})"]
        if info.config.get("auto_map")
        else []
    )
    own_code += [f"module {m} in modules.json" for m in info.sentence_config.get("custom_modules", [])]
    if own_code and not model.trust_remote_code:
        raise ValidationFailed(
            {"trust_remote_code": f"{model.name} needs its own Python code ({'; '.join(own_code)}): "
             "register it with trust_remote_code set if you trust that code"}
        )  # fmt: skip
    _record_inspection(model, info, source=source)


def _record_inspection(model: RegisteredModel, info: CheckpointInfo, *, source: str) -> None:
    with transaction.atomic():
        recorded = states.inspection_transition(
            model_id=model.pk,
            to=Inspection.READY,
            path=str(Path(model.path).resolve()) if model.path else "",
            architecture=info.architecture,
            model_type=info.model_type,
            parameter_count=info.parameter_count,
            hidden_size=info.hidden_size,
            num_layers=info.num_layers,
            num_attention_heads=info.num_attention_heads,
            num_kv_heads=info.num_kv_heads,
            head_dim=info.head_dim,
            vocab_size=info.vocab_size,
            max_position_embeddings=info.max_position_embeddings,
            torch_dtype=info.torch_dtype,
            size_bytes=info.size_bytes,
            tokenizer_files=info.tokenizer_files,
            fingerprint=info.fingerprint,
            config=info.config,
            chat_template=info.chat_template,
            special_tokens=info.special_tokens,
            sentence_config=info.sentence_config,
            notice=info.notice,
        )
        if not recorded:
            return
        CheckpointCopy.objects.update_or_create(
            model=model, host=model.host, defaults={"fingerprint": info.fingerprint, "checked_at": timezone.now()}
        )
        params = f", {info.parameter_count / 1e6:.0f}M parameters" if info.parameter_count else ""
        events.record(
            kind="model.inspected",
            source=source,
            model=model,
            message=f"{model.name}: {info.architecture or info.model_type}{params}, "
            f"{info.size_bytes / 1e6:.0f} MB, fingerprint {info.fingerprint[:12]}",
        )


def checkpoint_copy_record(
    *, model_id: int, host_name: str, fingerprint: str | None, source: str, why: str = ""
) -> None:
    """What ``host_name``'s agent found at a registered model's path: the files'
    fingerprint, or None when no checkpoint is there (its copy is forgotten;
    ``why``: removed or evicted). Said on the model's timeline when a copy is
    found, changes or goes."""
    with transaction.atomic():
        model = RegisteredModel.objects.filter(pk=model_id, inspection=Inspection.READY).first()
        host = GpuHost.objects.filter(name=host_name).first()
        if model is None or host is None:
            return
        copy = CheckpointCopy.objects.select_for_update().filter(model=model, host=host).first()
        before = copy.fingerprint if copy is not None else None
        if fingerprint == before:  # another look recorded it meanwhile
            return
        where = f"{model.name}'s checkpoint on {host_name}" + (f" ({model.path})" if model.path else "")
        if fingerprint is None:
            message, kind = (
                f"{where} is gone{f' ({why})' if why else ''}: no replica is placed there",
                "model.copy_gone",
            )
        elif fingerprint == model.fingerprint:
            message, kind = (
                f"{where} is found and matches its fingerprint: replicas may be placed there",
                "model.copy_found",
            )
        else:
            message, kind = (
                f"{where} differs from the registered files (fingerprint {fingerprint[:12]}, registered "
                f"{model.fingerprint[:12]}): no replica is placed there until it matches", "model.copy_differs"
            )  # fmt: skip
        if copy is None:
            CheckpointCopy.objects.create(model=model, host=host, fingerprint=fingerprint)
        elif fingerprint is not None:
            CheckpointCopy.objects.filter(pk=copy.pk).update(fingerprint=fingerprint, checked_at=timezone.now())
        events.record(kind=kind, source=source, model=model, host=host, message=message)
        if fingerprint is None:
            CheckpointCopy.objects.filter(pk=copy.pk).delete()


def model_inspection_failed(*, model_id: int, reason: str, source: str) -> None:
    """The host could not read the checkpoint: the model shows failed with ``reason``."""
    with transaction.atomic():
        if not states.inspection_transition(model_id=model_id, to=Inspection.FAILED, message=reason):
            return
        model = RegisteredModel.objects.get(pk=model_id)
        events.record(kind="model.inspection_failed", source=source, model=model, message=reason)
