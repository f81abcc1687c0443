"""Gantry's version, in one place: pyproject.toml's, as the installed package
reports it (read from pyproject.toml itself in a checkout that is not
installed). `gantry --version`, the pages' footer and the API schema show it."""

from __future__ import annotations

import re
from functools import cache
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


@cache
def version() -> str:
    try:
        return metadata.version("gantry")
    except metadata.PackageNotFoundError:
        found = re.search(r'^version = "([^"]+)"', PYPROJECT.read_text(), re.MULTILINE)
        return found.group(1) if found else "unknown"
