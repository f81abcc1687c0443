"""Make a thing on disk once, whichever process asks first."""

from __future__ import annotations

import fcntl
from collections.abc import Callable
from pathlib import Path


def make_once(folder: Path, done: Callable[[], bool], make: Callable[[], None]) -> None:
    """``make()`` unless ``done()``, under a file lock in ``folder``: what a host
    prepares for its servers (the backends folder) is made
    once, whichever of its worker processes asks first."""
    if done():
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done():
            make()
