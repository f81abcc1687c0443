"""The demo's SQLite database is readable by its owner only, from its first
byte, and one an older release left readable is narrowed (SQLite gives its
-wal and -shm files the database's mode)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _migrate(database: Path) -> None:
    env = {"PATH": os.environ["PATH"], "HOME": str(database.parent), "SECRET_KEY": "x",
           "DATABASE_URL": f"sqlite:///{database}", "GANTRY_DATA_DIR": str(database.parent)}  # fmt: skip
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True, timeout=300)


def test_a_new_sqlite_database_is_0600(tmp_path: Path):
    database = tmp_path / "data" / "gantry.sqlite3"
    _migrate(database)
    assert _mode(database) == 0o600


def test_an_older_releases_readable_database_is_narrowed(tmp_path: Path):
    database = tmp_path / "gantry.sqlite3"
    database.touch()
    database.chmod(0o644)
    _migrate(database)
    assert _mode(database) == 0o600
