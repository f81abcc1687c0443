"""Where a process tree's Prometheus samples live in multiprocess mode.

Apart from common.metrics because prometheus_client picks its value store when
it is first imported: the parent (gunicorn's master, the host worker) sets the
folder up here, before anything in its tree imports prometheus_client, so
that its children write samples to files a scrape of any of them reads."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

ENV = "PROMETHEUS_MULTIPROC_DIR"
SHM = "/dev/shm"
_made: Path | None = None  # the temporary folder prepare() made, removed at exit


def prepare(prefix: str) -> Path:
    """PROMETHEUS_MULTIPROC_DIR if set, else a new temporary folder (in memory
    where /dev/shm is), emptied and named in the environment the children
    inherit: counters start from zero with the server, as Prometheus expects of
    a restart."""
    global _made
    given = os.environ.get(ENV)
    folder = Path(given) if given else Path(tempfile.mkdtemp(prefix=prefix, dir=_memory_backed()))
    _made = None if given else folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, mode=0o700)
    os.environ[ENV] = str(folder)
    return folder


def _memory_backed() -> str | None:
    """/dev/shm where there is one: the samples are memory-mapped files written on
    every request, and on a disk a write may wait on the kernel writing the page
    back; in memory it never does."""
    return SHM if os.path.isdir(SHM) and os.access(SHM, os.W_OK) else None


def remove_made() -> None:
    """Remove the temporary folder prepare() made (one the operator named stays)."""
    if _made is not None:
        shutil.rmtree(_made, ignore_errors=True)
