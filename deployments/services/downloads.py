"""Hub downloads: a host fetching a registered hub model into its own cache.

A model registered by hub id (no folder) gets its first download on the host
named at registration; that host resolves the revision to a commit, which
every later download on another host fetches. The host's worker
(workers.downloads) reports progress on the row and says how it ended; the
first host then inspects the files, and every host records its copy, so
placement finds it (replica_placement.holding_hosts).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from common.errors import InvalidTransition, NotFound, ValidationFailed
from core import events, queues
from core.permissions import require_operator
from deployments import states
from deployments.models import DownloadStatus as D
from deployments.models import Inspection, ModelDownload, RegisteredModel
from hosts import outbox
from hosts.models import GpuHost

# At most this many patterns of each kind, each at most PATTERN_LENGTH characters.
MAX_PATTERNS = 50
PATTERN_LENGTH = 200


def check_patterns(field: str, patterns: Any) -> list[str]:
    """The allow or ignore patterns as a list of strings; ValidationFailed naming
    ``field`` and the rule otherwise."""
    if not isinstance(patterns, list) or not all(isinstance(p, str) and p.strip() for p in patterns):
        raise ValidationFailed({field: "must be a list of non-empty glob patterns (`*.safetensors`, `tokenizer*`)"})
    if len(patterns) > MAX_PATTERNS or any(len(p) > PATTERN_LENGTH for p in patterns):
        raise ValidationFailed({field: f"at most {MAX_PATTERNS} patterns of at most {PATTERN_LENGTH} characters"})
    return [p.strip() for p in patterns]


def download_start(*, model: RegisteredModel, host: GpuHost, user: Any, why: str) -> ModelDownload:
    """Create a download row and send its task (inside the caller's transaction)."""
    try:
        with transaction.atomic():
            download = ModelDownload.objects.create(model=model, host=host, created_by=events.signed_in(user))
    except IntegrityError as exc:
        raise ValidationFailed({"host": f"{host.name} is already downloading {model.name}"}) from exc
    events.record(
        kind="model.download",
        source=events.source_of(user),
        actor=user,
        model=model,
        host=host,
        to_status=D.PENDING,
        message=f"{model.name} on {host.name}: {why}",
        data={"download": download.pk},
    )
    outbox.enqueue_on_commit(queues.RUN_DOWNLOAD, host_name=host.name, args=[download.pk])
    return download


def download_request(*, model_id: int, host: str, user: Any = None) -> ModelDownload:
    """Ask ``host`` to download a hub model registered already (at the commit its
    first download resolved); on the model's own host, after its first download
    failed or was cancelled, that download again. Refused for a model with a
    folder of its own, a host that holds it or is fetching it."""
    require_operator(user)
    with transaction.atomic():
        model = RegisteredModel.objects.select_for_update().filter(pk=model_id).first()
        if model is None:
            raise NotFound(f"model {model_id} does not exist")
        target = GpuHost.objects.filter(name=host).first()
        if target is None:
            raise ValidationFailed({"host": f"no GPU host named {host!r}"})
        if not model.downloaded:
            raise InvalidTransition(
                f"{model.name} is a folder registered at {model.path}: copy it to the same path on {host}"
            )
        if model.downloads.filter(host=target, status__in=states.DOWNLOAD_ACTIVE).exists():
            raise InvalidTransition(f"{host} is downloading {model.name} already")
        if model.inspection != Inspection.READY:
            if target != model.host:
                raise InvalidTransition(f"{model.name}'s first download has not finished: ask again once it is ready")
            # Its first download ended without a model (failed or cancelled): again, from what it left.
            states.inspection_transition(model_id=model.pk, to=Inspection.PENDING)
            return download_start(model=model, host=target, user=user, why="its first download, asked again")
        if model.copies.filter(host=target, fingerprint=model.fingerprint).exists():
            raise InvalidTransition(f"{host} holds {model.name} already")
        return download_start(model=model, host=target, user=user, why=f"asked for {model.hub_id}@{model.commit[:12]}")


def download_cancel(*, download_id: int, user: Any = None) -> ModelDownload:
    """Cancel a download: one waiting ends at once, one running stops within a
    second (its partial files stay in the cache, so asking again resumes)."""
    require_operator(user)
    download = ModelDownload.objects.filter(pk=download_id).first()
    if download is None:
        raise NotFound(f"download {download_id} does not exist")
    to = D.CANCELLED if download.status == D.PENDING else D.CANCELLING
    return states.download_transition(
        download_id=download_id, to=to, source=events.source_of(user), actor=user, message="cancel asked"
    )


def download_progress(*, download_id: int, **figures: int | str) -> str:
    """What a host's worker measured (bytes and files done, rate, totals) with a
    heartbeat (and the commit it fetches); returns the download's status, so the
    worker sees a cancel."""
    with transaction.atomic():
        ModelDownload.objects.filter(pk=download_id, status__in=[D.RUNNING, D.CANCELLING]).update(
            heartbeat_at=timezone.now(), **figures
        )
        return ModelDownload.objects.filter(pk=download_id).values_list("status", flat=True).first() or D.FAILED


def model_commit_record(*, model_id: int, commit: str) -> str:
    """The commit the model's first download resolved its revision to; every
    later download fetches the one recorded first. Returns that commit."""
    RegisteredModel.objects.filter(pk=model_id, commit="").update(commit=commit)
    return RegisteredModel.objects.filter(pk=model_id).values_list("commit", flat=True).first() or commit


def download_redrive(*, download_id: int, source: str, message: str) -> bool:
    """Send a waiting (or orphaned running) download's task again; False when it
    has ended or a task still waits in the outbox."""
    with transaction.atomic():
        rows = ModelDownload.objects.select_related("host").select_for_update(of=("self",))
        download = rows.filter(pk=download_id).first()
        if download is None or download.status not in (D.PENDING, D.RUNNING):
            return False
        return outbox.redrive(
            queues.RUN_DOWNLOAD,
            host_name=download.host.name,
            args=[download.pk],
            source=source,
            message=message,
            model=download.model,
        )


def _downloads_resend(host_name: str, source: str, message: str) -> list[str]:
    # Running ones too: a worker that starts finds none of its own running, so a
    # running row lost its worker; a live one's duplicate task finds the download
    # locked on the host and leaves it (workers.downloads).
    waiting = ModelDownload.objects.filter(host__name=host_name, status__in=[D.PENDING, D.RUNNING])
    return [
        f"download {pk}"
        for pk in waiting.values_list("pk", flat=True)
        if download_redrive(download_id=pk, source=source, message=message)
    ]


outbox.register(
    outbox.HostTask(
        queues.RUN_DOWNLOAD,
        about=lambda pk: {"model": found.model} if (found := ModelDownload.objects.filter(pk=pk).first()) else {},
        resend_waiting=_downloads_resend,
    )
)


def downloads_reap() -> list[int]:
    """Fail downloads whose host stopped reporting them (GANTRY_BUILD_STALE_AFTER),
    so none shows running forever; asking again resumes from its files."""
    cutoff = timezone.now() - timedelta(seconds=settings.GANTRY_BUILD_STALE_AFTER)
    stale = ModelDownload.objects.filter(status__in=[D.RUNNING, D.CANCELLING], heartbeat_at__lt=cutoff)
    reaped = []
    for pk in stale.values_list("pk", flat=True):
        try:
            states.download_transition(
                download_id=pk,
                to=D.FAILED,
                source="system",
                message=f"its host stopped reporting for {settings.GANTRY_BUILD_STALE_AFTER} s; ask again to resume",
            )
        except InvalidTransition:
            continue
        reaped.append(pk)
    return reaped
