"""Which registered checkpoints this host holds, for placement.

The agent's second thread looks, every SURVEY_EVERY_S, for each inspected
model's folder at its path on this host's disk (within GANTRY_MODEL_ROOTS,
inspect_checkpoint's rules). A folder found is fingerprinted again only when
its files' names, sizes or modification times changed since the last look;
a change, a new copy or a copy gone is recorded
(registered_models.checkpoint_copy_record), so a folder copied to the same
path on another host makes that host a candidate within seconds, and one
removed or edited stops new replicas going there. Hashing a large checkpoint
takes seconds to minutes: it runs here, beside the heartbeat, never in it.
"""

from __future__ import annotations

import logging
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

# By model: the signature of the files last hashed (name, size, mtime of each) and their fingerprint.
_hashed: dict[int, tuple[tuple, str]] = {}


def _fingerprint(model_id: int, path: Path) -> str | None:
    """The fingerprint of the checkpoint at ``path`` (None: none is here), from
    the last hash while its files have not changed."""
    files = checkpoint_files(path, settings.GANTRY_MODEL_ROOTS)
    if files is None:
        _hashed.pop(model_id, None)
        return None
    try:
        signature = tuple((str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
        known = _hashed.get(model_id)
        if known is not None and known[0] == signature:
            return known[1]
        found = fingerprint(path, files)
    except OSError:  # a file went while it was read: looked at again next time
        return None
    _hashed[model_id] = (signature, found)
    return found


def survey() -> None:
    """Look once for every inspected model's folder; record what changed."""
    host = settings.GANTRY_HOST_NAME
    held = dict(CheckpointCopy.objects.filter(host__name=host).values_list("model_id", "fingerprint"))
    for model_id, path in RegisteredModel.objects.filter(inspection=Inspection.READY).values_list("pk", "path"):
        found = _fingerprint(model_id, Path(path))
        if found != held.get(model_id):
            registered_models.checkpoint_copy_record(
                model_id=model_id, host_name=host, fingerprint=found, source=source()
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
