"""Loaded first (``-p tests.parallel``, before Django reads its settings):
under pytest-xdist each worker process gets a Redis database of its own, as
pytest-django gives it a PostgreSQL database of its own. The stacks of two
workers would otherwise share the channel layer's groups and Gantry's keys,
which name rows by id, and each worker's rows start at id 1."""

from __future__ import annotations

import os
import re

_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and os.environ.get("REDIS_URL"):
    _base = re.fullmatch(r"(.*/)(\d+)", os.environ["REDIS_URL"])
    if _base is None:
        raise RuntimeError(f"REDIS_URL must end in a database number to run in parallel: {os.environ['REDIS_URL']}")
    os.environ["REDIS_URL"] = f"{_base[1]}{int(_base[2]) - int(_worker[2:])}"
