"""The one job runner: every way a job can end badly becomes one failed state
with a reason a person reads."""

from __future__ import annotations

import logging

import pytest

from common.errors import PermanentError, TransientError, ValidationFailed
from workers.jobs import JobFailed, run_job


def _run(work):  # noqa: ANN001, ANN202
    calls = []
    run_job("launch", work, fail=lambda reason, *, status, details: calls.append((reason, status, details)))
    return calls


def _raise(exc: BaseException):  # noqa: ANN202
    def work() -> None:
        raise exc

    return work


def test_a_job_that_finishes_records_no_failure():
    assert _run(lambda: None) == []


def test_job_failed_keeps_its_words_its_end_status_and_details():
    calls = _run(_raise(JobFailed("cancelled", status="cancelled", exit_code=137)))
    assert calls == [("cancelled", "cancelled", {"exit_code": 137})]


def test_broken_rules_read_as_the_rules():
    calls = _run(_raise(ValidationFailed({"path": "is not a folder", "kind": ["must be llm", "or embedding"]})))
    assert calls == [("is not a folder must be llm or embedding", None, {})]


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (PermanentError("port 8000 is in use"), "launch failed: port 8000 is in use"),
        (TransientError("Docker engine not reachable"), "launch failed: Docker engine not reachable"),
        (FileNotFoundError(2, "No such file or directory", "/models/x"), "launch failed: [Errno 2] No such file"),
    ],
)
def test_outside_system_errors_say_what_failed_and_why(exc, reason):
    [(said, status, _)] = _run(_raise(exc))
    assert said.startswith(reason) and status is None


def test_a_bug_is_named_by_its_type_and_logged_with_its_traceback(caplog, settings):
    settings.GANTRY_HOST_NAME = "gpu-7"
    with caplog.at_level(logging.ERROR, logger="workers.jobs"):
        [(said, _, _)] = _run(_raise(KeyError("hidden_size")))
    assert said == (
        "launch failed on an unexpected error (KeyError: 'hidden_size'); the worker log on gpu-7 has the details"
    )
    assert "Traceback" in caplog.text
