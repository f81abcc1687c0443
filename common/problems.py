"""The one shape of every error under /api/ (the API, the lean generate path,
Django's own 404 and 500 there, the idempotency guard)."""

from __future__ import annotations

from typing import Any


def problem(code: int, kind: str, detail: str, errors: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """The status code again, a machine-readable ``code``, a ``detail`` line for
    people, and for bad input ``errors``: each broken rule by field path
    (``spec.dtype``, ``models[0].gpu_ids``)."""
    return {"status": code, "code": kind, "detail": detail, "errors": errors or {}}
