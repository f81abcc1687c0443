"""Inspecting a registered checkpoint on this host: after its registration
(workers.tasks.inspect_model) or its first hub download (workers.downloads)."""

from __future__ import annotations

from deployments.services import registered_models
from workers.jobs import run_job, source


def inspect(model_id: int) -> None:
    """Inspect a registered checkpoint on this host; a checkpoint that cannot be
    read leaves the model failed with the reason."""
    run_job(
        "inspection",
        lambda: registered_models.model_inspect(model_id=model_id, source=source()),
        fail=lambda reason, *, status, details: registered_models.model_inspection_failed(
            model_id=model_id, reason=reason, source=source()
        ),
    )
