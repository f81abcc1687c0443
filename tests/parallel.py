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


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001
    """Each test file's time (set-up, call and tear-down summed) and each
    worker's, beside --durations' slowest tests: with --dist loadfile a file is
    the unit a worker takes, so these say where the run's length is."""
    files: dict[str, float] = {}
    workers: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            seconds = getattr(report, "duration", None)
            if seconds is None or not getattr(report, "nodeid", ""):
                continue
            path = report.nodeid.split("::", 1)[0]
            files[path] = files.get(path, 0.0) + seconds
            node = getattr(report, "node", None)
            worker = getattr(getattr(node, "gateway", None), "id", "main")
            workers[worker] = workers.get(worker, 0.0) + seconds
    if not files:
        return
    terminalreporter.write_sep("=", "slowest 25 test files (seconds)")
    for path, seconds in sorted(files.items(), key=lambda item: -item[1])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    terminalreporter.write_line("workers: " + ", ".join(f"{w} {s:.0f} s" for w, s in sorted(workers.items())))
