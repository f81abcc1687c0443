"""A generation that failed gives way to the one before it. Apart from
services.deployments (changes make generations) so that services.replicas,
whose roll finds the failure, and the worker can both call it; neither
imports the other's way back."""

from __future__ import annotations

from django.db import transaction

from common.errors import InvalidTransition
from core import events
from deployments import states
from deployments.models import Deployment, RevisionStatus
from deployments.services.placements import placement_from_snapshot, placements_write
from deployments.services.replica_placement import replicas_plan_write


def deployment_rollback(*, deployment_id: int, failed_generation: int, reason: str, source: str) -> Deployment:
    """Put back the placements of the generation before ``failed_generation``
    (the replicas that took it roll back to them, one at a time); the failed
    revision keeps its reason."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=deployment_id)
        if deployment.generation != failed_generation:
            raise InvalidTransition(
                f"{deployment.name} is at generation {deployment.generation}, not {failed_generation}"
            )
        previous = deployment.revisions.filter(status=RevisionStatus.SUPERSEDED).order_by("-generation").first()
        if previous is None:
            raise InvalidTransition(f"{deployment.name} has no earlier generation to roll back to")
        placements_write(deployment=deployment, resolved=[placement_from_snapshot(item) for item in previous.spec])
        Deployment.objects.filter(pk=deployment.pk).update(generation=previous.generation)
        replicas_plan_write(deployment.pk)
        states.revision_transition(
            deployment_id=deployment.pk, generation=failed_generation, to=RevisionStatus.FAILED, message=reason
        )
        states.revision_transition(
            deployment_id=deployment.pk, generation=previous.generation, to=RevisionStatus.CURRENT
        )
        events.record(
            kind="deployment.rollback",
            source=source,
            deployment=deployment,
            message=f"generation {failed_generation} failed ({reason}); back to generation {previous.generation}",
        )
    return Deployment.objects.get(pk=deployment_id)
