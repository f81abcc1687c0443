"""Which registered checkpoints this host holds, for placement.

The agent's second thread looks, every SURVEY_EVERY_S, for each inspected
model's folder on this host's disk (its path, or its snapshot in the host's
hub cache) (within GANTRY_MODEL_ROOTS,
inspect_checkpoint's rules). A folder found is fingerprinted again only when
its files' names, sizes or modification times changed since the last look
(remembered in the host's data folder, across restarts);
a change, a new copy or a copy gone is recorded
(registered_models.checkpoint_copy_record), so a folder copied to the same
path on another host makes that host a candidate within seconds, and one
removed or edited stops new replicas going there. Hashing a large checkpoint
takes seconds to minutes: it runs here, beside the heartbeat, never in it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from django.conf import settings
from django.db import close_old_connections

from deployments.models import CheckpointCopy, Inspection, RegisteredModel
from deployments.services import registered_models
from upstream.checkpoints import checkpoint_files, fingerprint
from workers.jobs import source

log = logging.getLogger(__name__)

SURVEY_EVERY_S = 2.0

# By checkpoint folder: the signature of the files last hashed ([name, size, mtime] of each) and
# their fingerprint; kept in the host's data folder, so a restarted worker hashes nothing again.
_hashed: dict[str, tuple[list, str]] | None = None


def _kept() -> Path:
    return Path(settings.GANTRY_DATA_DIR) / "checkpoint-hashes.json"


def _hashes() -> dict[str, tuple[list, str]]:
    global _hashed
    if _hashed is None:
        try:
            _hashed = {path: (signature, found) for path, (signature, found) in json.loads(_kept().read_text()).items()}
        except (OSError, ValueError, TypeError):
            _hashed = {}
    return _hashed


def _keep() -> None:
    kept = _kept()
    kept.parent.mkdir(parents=True, exist_ok=True)
    partial = kept.with_name(f"{kept.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(_hashes()))
    partial.replace(kept)


def _fingerprint(path: Path) -> str | None:
    """The fingerprint of the checkpoint at ``path`` (None: none is here), from
    the last hash while its files have not changed."""
    files = checkpoint_files(path, settings.GANTRY_MODEL_ROOTS)
    hashed = _hashes()
    if files is None:
        if hashed.pop(str(path), None) is not None:
            _keep()
        return None
    try:
        signature = [[str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
        known = hashed.get(str(path))
        if known is not None and known[0] == signature:
            return known[1]
        found = fingerprint(path, files)
    except OSError:  # a file went while it was read: looked at again next time
        return None
    hashed[str(path)] = (signature, found)
    _keep()
    return found


def survey() -> None:
    """Look once for every inspected model's folder; record what changed."""
    held = dict(
        CheckpointCopy.objects.filter(host__name=settings.GANTRY_HOST_NAME).values_list("model_id", "fingerprint")
    )
    registered = list(RegisteredModel.objects.filter(inspection=Inspection.READY).only("path", "hub_id", "commit"))
    for model in registered:
        _record(model, held.get(model.pk))
    hashed = _hashes()
    forgotten = set(hashed) - {str(model.folder) for model in registered}  # models unregistered since
    if forgotten:
        for path in forgotten:
            del hashed[path]
        _keep()


def look_at(model: RegisteredModel) -> None:
    """Record what this host holds of ``model`` now, if it changed (after a download)."""
    on_record = CheckpointCopy.objects.filter(host__name=settings.GANTRY_HOST_NAME, model=model)
    _record(model, on_record.values_list("fingerprint", flat=True).first())


def _record(model: RegisteredModel, held: str | None) -> None:
    """Record ``model``'s copy here when what this host holds differs from ``held``
    (the fingerprint on record; None for no copy)."""
    found = _fingerprint(model.folder)
    if found != held:
        registered_models.checkpoint_copy_record(
            model_id=model.pk, host_name=settings.GANTRY_HOST_NAME, fingerprint=found, source=source()
        )


def run_forever(stop: threading.Event) -> None:
    """survey() every SURVEY_EVERY_S until ``stop``; a failed look (the database
    away) is tried again at the next."""
    while not stop.is_set():
        close_old_connections()
        try:
            survey()
        except Exception:  # noqa: BLE001 - the thread must outlive a database restart
            log.debug("checkpoint survey failed", exc_info=True)
        stop.wait(SURVEY_EVERY_S)
