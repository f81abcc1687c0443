"""This host's hub cache (GANTRY_HUB_CACHE): how much it holds, its quota
(GANTRY_HUB_CACHE_QUOTA_GB), and removing a model from it.

Before a download, ``make_room`` evicts models until the download fits the
quota: least recently used first (a copy's ``used_at``: its last launch here,
else when it arrived), never one that a replica on this host runs or wants to
run, never one pinned here. A model is removed by its snapshot folder, then
every blob of its repository that no snapshot left links to.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from django.conf import settings
from django.db.models.functions import Coalesce
from django.template.defaultfilters import filesizeformat

from core import events
from deployments import selectors
from deployments.models import CheckpointCopy, RegisteredModel
from deployments.services import registered_models
from hosts.models import GpuHost
from workers.jobs import JobFailed, source

GB = 1024**3


def usage(cache: Path) -> int:
    """Bytes the cache's repositories hold (blobs and partial files; links count nothing)."""
    total = 0
    for blobs in cache.glob("models--*/blobs"):
        for entry in os.scandir(blobs):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def make_room(needed: int, *, keep: RegisteredModel) -> list[str]:
    """Evict what the quota needs for ``needed`` more bytes (``keep`` is the
    model being fetched); the names evicted. JobFailed, evicting nothing, when
    even every evictable model gone would not make room."""
    quota = int(settings.GANTRY_HUB_CACHE_QUOTA_GB * GB)
    cache = Path(settings.GANTRY_HUB_CACHE)
    if not quota:
        return []
    used = usage(cache)
    if used + needed <= quota:
        return []
    host = settings.GANTRY_HOST_NAME
    copies = (
        CheckpointCopy.objects.select_related("model")
        .filter(host__name=host, pinned=False, model__path="")
        .exclude(model=keep)
        .order_by(Coalesce("used_at", "checked_at"), "pk")
    )
    candidates = [c.model for c in copies if not selectors.replicas_using(c.model.pk, host)]
    sizes = {m.pk: _size(m) for m in candidates}
    if used - sum(sizes.values()) + needed > quota:
        kept = CheckpointCopy.objects.filter(host__name=host).exclude(model__in=candidates).exclude(model=keep)
        held = ", ".join(sorted(kept.values_list("model__name", flat=True))) or "nothing else"
        raise JobFailed(
            f"the hub cache's quota on {host} ({filesizeformat(quota)}, GANTRY_HUB_CACHE_QUOTA_GB) cannot take "
            f"{keep.name}'s {filesizeformat(needed)}: {filesizeformat(used)} is used, and what holds it is in use "
            f"or pinned here ({held}); nothing was evicted or downloaded"
        )
    evicted = []
    for model in candidates:
        if used + needed <= quota:
            break
        used -= remove(model, why=f"evicted, least recently used, to make room for {keep.name}")
        evicted.append(model.name)
    return evicted


def _size(model: RegisteredModel) -> int:
    """What removing ``model`` would free: the blobs only its snapshot links to."""
    folder = model.folder
    mine = _linked(folder)
    others = set().union(*(_linked(s) for s in folder.parent.glob("*") if s != folder))
    return sum(blob.stat().st_size for blob in mine - others if blob.exists())


def _linked(snapshot: Path) -> set[Path]:
    return {link.resolve() for link in snapshot.rglob("*") if link.is_symlink() or link.is_file()}


def remove(model: RegisteredModel, *, why: str) -> int:
    """Remove a hub model from this host's cache (its snapshot, and the blobs no
    other snapshot links to) and record its copy gone; the bytes freed."""
    folder = model.folder
    storage = folder.parent.parent
    mine = _linked(folder) if folder.exists() else set()
    shutil.rmtree(folder, ignore_errors=True)
    still = set().union(*(_linked(s) for s in storage.glob("snapshots/*")))
    freed = 0
    for blob in mine - still:
        if blob.parent == storage / "blobs" and blob.exists():
            freed += blob.stat().st_size
            blob.unlink()
    if not any(storage.glob("snapshots/*")):
        shutil.rmtree(storage, ignore_errors=True)
    registered_models.checkpoint_copy_record(
        model_id=model.pk, host_name=settings.GANTRY_HOST_NAME, fingerprint=None, source=source(), why=why
    )
    return freed


def remove_asked(model_id: int) -> None:
    """A person asked to remove the model from this host (copy_remove): done
    unless a replica here started using it since."""
    model = RegisteredModel.objects.filter(pk=model_id).first()
    if model is None or not model.downloaded:
        return
    host = settings.GANTRY_HOST_NAME
    using = selectors.replicas_using(model_id, host)
    if using:
        events.record(
            kind="model.copy_kept", source=source(), model=model, host=GpuHost.objects.filter(name=host).first(),
            message=f"{model.name} was not removed from {host}: {', '.join(using)} started using it meanwhile",
        )  # fmt: skip
        return
    size = _size(model)
    remove(model, why=f"removed on request, {filesizeformat(size)} freed")
