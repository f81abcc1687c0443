"""Gantry's version: the installed package's, or pyproject.toml's in a checkout
that runs without being installed (a GPU host running from a copy of the tree)."""

from __future__ import annotations

import functools
import re
from importlib import metadata
from pathlib import Path

_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@functools.cache
def gantry_version() -> str:
    try:
        return metadata.version("gantry")
    except metadata.PackageNotFoundError:
        found = re.search(r'^version = "([^"]+)"', _PYPROJECT.read_text(), re.MULTILINE)
        return found.group(1) if found else "unknown"
