"""The access app's periodic work (the beat's queue "control")."""

from __future__ import annotations

from celery import shared_task

from access.oidc import identities_recheck


@shared_task(name="access.tasks.recheck_identities")
def recheck_identities() -> list[str]:
    """Single sign-on: ask the provider again about each person due a check."""
    return identities_recheck()
