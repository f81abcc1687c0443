"""Hub downloads: a host fetching a registered hub model into its own cache.

A model registered by hub id (no folder) gets its first download on the host
named at registration; that host resolves the revision to a commit, which
every later download on another host fetches: asked for (download_request),
or because a replica was placed on a host that lacks the model
(replica_placement prefers hosts that hold it): its launch finds the files
missing and the replica waits, fetching, for the download
(replica_fetch), then launches, or fails with the download's reason. The
host's worker (workers.downloads) reports progress on the row and says how it
ended (download_end); the first host then inspects the files, and every host
records its copy, so placement finds it (replica_placement.holding_hosts).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.template.defaultfilters import filesizeformat
from django.utils import timezone

from common import pki
from common.errors import InvalidTransition, NotFound, PermissionDenied, ValidationFailed
from core import events, queues
from core.permissions import require_operator
from deployments import selectors, states
from deployments.models import CheckpointCopy, Inspection, ModelDownload, RegisteredModel, Replica
from deployments.models import DeploymentStatus as S
from deployments.models import DownloadStatus as D
from deployments.services import replicas
from hosts import outbox
from hosts.models import ChannelCertificate, GpuHost

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
    if download.status == D.PENDING:
        return download_end(download_id=download_id, to=D.CANCELLED, source=events.source_of(user), actor=user,
                            message="cancelled before it started")  # fmt: skip
    return states.download_transition(
        download_id=download_id, to=D.CANCELLING, source=events.source_of(user), actor=user, message="cancel asked"
    )


def download_end(*, download_id: int, to: str, source: str, message: str, actor: Any = None) -> ModelDownload:
    """End a download (succeeded, failed or cancelled), and move the replicas on
    its host that wait for it: launching once every model they lack is here,
    failed with its reason when it did not succeed. A model's first download
    that failed leaves the model failed with the reason (asking again retries)."""
    with transaction.atomic():
        download = states.download_transition(
            download_id=download_id, to=to, source=source, actor=actor, message=message
        )
        if to == D.FAILED and download.is_first:
            states.inspection_transition(
                model_id=download.model_id, to=Inspection.FAILED,
                message=f"its download on {download.host.name}: {message}",
            )  # fmt: skip
        waiting = Replica.objects.select_related("deployment", "host").filter(
            host=download.host, status=S.FETCHING, deployment__placements__registered_model=download.model
        )
        for replica in waiting.distinct():
            if to != D.SUCCEEDED:
                replicas.replica_fail(
                    replica_id=replica.pk, source=source, only_from=frozenset({S.FETCHING}),
                    reason=f"its host could not fetch {download.model.name}: {message}",
                )  # fmt: skip
            elif not to_fetch(replica):
                replicas.replica_fetched(
                    replica=replica, source=source, message=f"{download.model.name} is here: starting its server"
                )
    return download


def to_fetch(replica: Replica) -> list[RegisteredModel]:
    """The hub models a replica's placements read that its host holds no
    matching copy of (RegisteredModel.fetchable)."""
    models = [p.registered_model for p in replica.deployment.placements.select_related("registered_model")]
    held = set(
        CheckpointCopy.objects.filter(host=replica.host, model__in=models).values_list("model_id", "fingerprint")
    )
    return [m for m in models if m.fetchable and (m.pk, m.fingerprint) not in held]


def replica_files_here(*, replica: Replica, source: str) -> bool:
    """Whether a launching replica's host holds the hub models it reads (their
    copies then stamped used now: the hub cache evicts the least recently used
    first). When it lacks some, the replica waits, fetching (replica_fetch)."""
    lacking = to_fetch(replica)
    if lacking:
        replica_fetch(replica=replica, models=lacking, source=source)
        return False
    models = replica.deployment.placements.values_list("registered_model_id", flat=True)
    CheckpointCopy.objects.filter(host=replica.host, model_id__in=models).update(used_at=timezone.now())
    return True


def replica_fetch(*, replica: Replica, models: list[RegisteredModel], source: str) -> None:
    """A launching replica whose host lacks ``models`` (hub models) waits,
    fetching, for their downloads on that host (an active one is joined)."""
    with transaction.atomic():
        rows = []
        for model in models:
            active = ModelDownload.objects.filter(model=model, host=replica.host, status__in=states.DOWNLOAD_ACTIVE)
            rows.append(
                active.first()
                or download_start(model=model, host=replica.host, user=None, why=f"{replica.label} waits for it")
            )
        states.replica_transition(
            replica_id=replica.pk, to=S.FETCHING, source=source, only_from=frozenset({S.LAUNCHING}),
            message=f"fetching {', '.join(f'{m.name} ({filesizeformat(m.size_bytes)})' for m in models)} from the "
            f"hub before it starts (download {', '.join(str(r.pk) for r in rows)})",
            data={"downloads": [r.pk for r in rows]},
        )  # fmt: skip


def download_progress(*, download_id: int, **figures: int | str) -> str:
    """What a host's worker measured (bytes and files done, rate, totals) with a
    heartbeat (and the commit it fetches); returns the download's status, so the
    worker sees a cancel."""
    with transaction.atomic():
        ModelDownload.objects.filter(pk=download_id, status__in=[D.RUNNING, D.CANCELLING]).update(
            heartbeat_at=timezone.now(), **figures
        )
        download = ModelDownload.objects.select_related("model").filter(pk=download_id).first()
        if download is None:
            return D.FAILED
        if download.bytes_total and "bytes_done" in figures:
            # The replicas waiting for it say how far it got (their status message, in the API and on the page).
            Replica.objects.filter(
                host_id=download.host_id, status=S.FETCHING, deployment__placements__registered_model=download.model
            ).update(status_message=_fetch_words(download))
        return download.status


def _fetch_words(download: ModelDownload) -> str:
    done, total = download.bytes_done, download.bytes_total
    left = f", {download.eta_s} s left" if download.eta_s is not None else ""
    rate = f", {filesizeformat(download.rate_bps)}/s" if download.rate_bps else ""
    return (f"fetching {download.model.name} (download {download.pk}): {100 * done // total} %, "
            f"{filesizeformat(done)} of {filesizeformat(total)}{rate}{left}")  # fmt: skip


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
        if download is None or download.status not in states.DOWNLOAD_ACTIVE:
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
    # Running (and cancelling) ones too: a worker that starts finds none of its own
    # running, so such a row lost its worker (the new one resumes it, or ends the
    # cancel); a live one's duplicate task finds the download locked on the host
    # and leaves it (workers.downloads).
    waiting = ModelDownload.objects.filter(host__name=host_name, status__in=states.DOWNLOAD_ACTIVE)
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
    so none shows running forever (one being cancelled ends cancelled); asking
    again resumes from its files."""
    cutoff = timezone.now() - timedelta(seconds=settings.GANTRY_BUILD_STALE_AFTER)
    stale = ModelDownload.objects.filter(status__in=[D.RUNNING, D.CANCELLING], heartbeat_at__lt=cutoff)
    reaped = []
    for pk, status in stale.values_list("pk", "status"):
        quiet = f"its host stopped reporting for {settings.GANTRY_BUILD_STALE_AFTER} s"
        try:
            if status == D.CANCELLING:
                download_end(download_id=pk, to=D.CANCELLED, source="system", message=f"cancelled ({quiet})")
            else:
                download_end(download_id=pk, to=D.FAILED, source="system", message=f"{quiet}; ask again to resume")
        except InvalidTransition:
            continue
        reaped.append(pk)
    return reaped


def _copy(model_id: int, host: str) -> CheckpointCopy:
    copy = CheckpointCopy.objects.select_related("model", "host").filter(model_id=model_id, host__name=host).first()
    if copy is None:
        if not RegisteredModel.objects.filter(pk=model_id).exists():
            raise NotFound(f"model {model_id} does not exist")
        raise NotFound(f"{host} holds no copy of model {model_id}")
    return copy


def copy_pin(*, model_id: int, host: str, pinned: bool, user: Any = None) -> CheckpointCopy:
    """Pin a hub model in ``host``'s cache (never evicted there), or unpin it."""
    require_operator(user)
    with transaction.atomic():
        copy = _copy(model_id, host)
        if not copy.model.downloaded:
            raise ValidationFailed(
                {"pinned": f"{copy.model.name} is a folder registered at {copy.model.path}; only a model downloaded "
                 "from the hub is in a host's cache (a folder is never evicted)"}
            )  # fmt: skip
        CheckpointCopy.objects.filter(pk=copy.pk).update(pinned=pinned)
        copy.pinned = pinned
        events.record(
            kind="model.copy_pinned" if pinned else "model.copy_unpinned",
            source=events.source_of(user), actor=user, model=copy.model, host=copy.host,
            message=f"{copy.model.name} on {host}: "
            + ("pinned: never evicted from its hub cache" if pinned else "unpinned: evicted when least recently used"),
        )  # fmt: skip
    return copy


def copy_remove(*, model_id: int, host: str, user: Any = None) -> None:
    """Remove a hub model from ``host``'s cache (its host does it, then records
    the copy gone). Refused for a folder registered by path, and while a
    replica on that host runs the model or wants to."""
    require_operator(user)
    with transaction.atomic():
        copy = _copy(model_id, host)
        model = copy.model
        if not model.downloaded:
            raise InvalidTransition(
                f"{model.name} is a folder registered at {model.path}: Gantry removes only what it downloaded"
            )
        using = selectors.replicas_using(model_id, host)
        if using:
            raise InvalidTransition(f"{', '.join(using)} use {model.name} on {host}: stop or move them first")
        events.record(
            kind="model.copy_remove", source=events.source_of(user), actor=user, model=model, host=copy.host,
            message=f"removing {model.name} from {host}'s hub cache",
        )  # fmt: skip
        outbox.enqueue_on_commit(queues.REMOVE_COPY, host_name=host, args=[model_id])


# --- the control plane's relay (GANTRY_HUB_VIA_CONTROL_PLANE) --------------------------

RELAY_PURPOSE = "gantry-hub-relay"


def relay_token_text(download_id: int) -> str:
    """What a host signs with its channel key to fetch a download through the relay."""
    return f"{RELAY_PURPOSE}:{download_id}"


@dataclass(frozen=True)
class Relay:
    """Where the relay fetches a download's files: a host that holds them."""

    download: ModelDownload
    holder: GpuHost


def relay_for(*, token: str) -> Relay:
    """The download a relay token (``<download id>.<signature>``) is for, and a
    host that holds its model. PermissionDenied unless the token is signed by
    the download's own host (with a channel certificate of its, neither revoked
    nor expired) and the download is active; NotFound when no host that holds
    the model can be reached over its channel."""
    download_id, _, proof = token.partition(".")
    download = (
        ModelDownload.objects.select_related("model", "host").filter(pk=int(download_id)).first()
        if download_id.isdigit()
        else None
    )
    if download is None or download.status not in states.DOWNLOAD_ACTIVE or not proof:
        raise PermissionDenied("no active download has this token")
    certificates = ChannelCertificate.objects.filter(host=download.host, revoked_at=None, not_after__gt=timezone.now())
    if not any(pki.proven(pki.load_cert(c.certificate), relay_token_text(download.pk), proof) for c in certificates):
        raise PermissionDenied(f"the token is not signed by {download.host.name}'s channel key")
    model = download.model
    holders = (
        GpuHost.objects.filter(checkpoint_copies__model=model, checkpoint_copies__fingerprint=model.fingerprint)
        .exclude(pk=download.host_id)
        .filter(channel_port__gt=0, channel_revoked=False)
        .order_by("-last_heartbeat")
    )
    holder = next((h for h in holders if h.is_online and not pki.is_loopback(h.address)), None)
    if holder is None:
        raise NotFound(f"no online host that holds {model.name} can be reached over its channel to relay it")
    return Relay(download=download, holder=holder)
