"""Where Gantry's own files are, in a source checkout and in an installed wheel.

In a checkout the pages' templates, static files and the manual's examples
sit at its top level (DESIGN.md); a wheel carries them as package data under
``controlplane/shipped/`` (setup.py copies them there at build time), since
pip installs nothing beside the packages. Read no environment here: the
settings and ``gantry`` both ask, before and after Django starts.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
# A checkout has manage.py beside the packages; site-packages never does.
SOURCE_CHECKOUT = (PACKAGE_ROOT / "manage.py").is_file() and (PACKAGE_ROOT / "templates").is_dir()
SHIPPED = PACKAGE_ROOT / "controlplane" / "shipped"
# What setup.py ships: each folder's place in a checkout. ``examples`` are the
# manual's files a user copies (Prometheus, Grafana); ``tools`` holds
# scripts/ensure-aiperf.sh with the aiperf.lock it reads, in the same layout.
SHIPPED_FOLDERS = {"templates": "templates", "static": "static", "examples": "docs", "tools": "."}


def shipped(folder: str) -> Path:
    """One of SHIPPED_FOLDERS: the checkout's own, or the wheel's copy."""
    if folder not in SHIPPED_FOLDERS:
        raise ValueError(f"{folder!r} is not shipped (one of {', '.join(SHIPPED_FOLDERS)})")
    if SOURCE_CHECKOUT:
        return (PACKAGE_ROOT / SHIPPED_FOLDERS[folder]).resolve()
    return SHIPPED / folder


def default_data_dir() -> Path:
    """GANTRY_DATA_DIR's default: ``var/`` in a checkout (make demo), else the
    user's data folder (``$XDG_DATA_HOME/gantry``, ``~/.local/share/gantry``),
    never site-packages."""
    if SOURCE_CHECKOUT:
        return PACKAGE_ROOT / "var"
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "gantry"
