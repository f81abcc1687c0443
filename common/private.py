"""Files only their owner may read: the demo's SQLite database (password
hashes, gateway key hashes and every deployment's Triton admin secret) is
created 0600 before SQLite opens it, so it is never readable by others, not
even for a moment; one made by an older release is narrowed the same way.
SQLite gives its -wal and -shm files the database's own mode."""

from __future__ import annotations

import os
from pathlib import Path


def private_file(path: Path) -> None:
    """Make ``path`` (and its folder) exist, the file with mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(descriptor, 0o600)
    finally:
        os.close(descriptor)
    for suffix in ("-wal", "-shm", "-journal"):
        sibling = path.with_name(path.name + suffix)
        if sibling.exists():
            os.chmod(sibling, 0o600)
