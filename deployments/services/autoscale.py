"""Autoscaling: the control plane's sweep moves a deployment's replica count
between its min and max from what its replicas' servers report.

The rule is Kubernetes' horizontal pod autoscaler's: wanted = ceil(ready ×
mean per replica / target), left alone within 10 % of the target. The metric
is the requests in each replica's Triton (queued and executing, the mean over
its last scrape interval) or its mean queue time per request. A change waits
``autoscale_cooldown_s`` after the last change of the count (a person's
scale included), grows at most to twice the count at once and shrinks by one
replica at a time, and only once every decision for a whole cooldown has
asked for fewer (HPA's scale-down stabilization). Every change, and every one held back by a bound or a
shortage of room, goes on the deployment's timeline with its reason.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import transaction
from django.utils import timezone

from common.errors import InvalidTransition, NotFound, NothingToChange, ValidationFailed
from core import events
from core.permissions import require_operator
from deployments import states
from deployments.models import AutoscaleMetric, Deployment, DeploymentStatus, DesiredState
from deployments.services import replicas as replicas_service

# Within this fraction of the target, the count is left as it is (HPA's default tolerance).
TOLERANCE = 0.1
SOURCE = "autoscaler"
_METRIC_WORDS = {AutoscaleMetric.IN_FLIGHT: "requests in flight", AutoscaleMetric.QUEUE_MS: "ms queue time"}


@dataclass(frozen=True)
class AutoscaleSpec:
    """A deployment's autoscaling settings; off while ``max_replicas`` is None.
    Defaults and bounds are Deployment's."""

    min_replicas: int | None = None
    max_replicas: int | None = None
    metric: str = AutoscaleMetric.IN_FLIGHT
    target: float = Deployment._meta.get_field("autoscale_target").get_default()
    cooldown_s: int = Deployment._meta.get_field("autoscale_cooldown_s").get_default()

    @property
    def on(self) -> bool:
        return self.max_replicas is not None

    def columns(self) -> dict[str, Any]:
        """The Deployment columns these settings are stored in."""
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "autoscale_metric": self.metric,
            "autoscale_target": self.target,
            "autoscale_cooldown_s": self.cooldown_s,
        }

    @classmethod
    def of(cls, deployment: Deployment) -> AutoscaleSpec:
        return cls(
            min_replicas=deployment.min_replicas,
            max_replicas=deployment.max_replicas,
            metric=deployment.autoscale_metric,
            target=deployment.autoscale_target,
            cooldown_s=deployment.autoscale_cooldown_s,
        )


AUTOSCALE_OFF = AutoscaleSpec()


def autoscale_errors(spec: AutoscaleSpec, replicas: int) -> dict[str, list[str]]:
    """Every autoscaling rule ``spec`` breaks, by field (as the API names them)."""
    errors: dict[str, list[str]] = {}
    for field, column in spec_fields().items():
        value = getattr(spec, field)
        try:
            Deployment._meta.get_field(column).clean(value, None)
        except DjangoValidationError as exc:
            errors[field] = list(exc.messages)
    if spec.min_replicas is not None and not spec.on:
        errors.setdefault("max_replicas", []).append("min_replicas needs max_replicas: autoscaling is on with both")
    if errors or not spec.on:
        return errors
    low = spec.min_replicas or 1
    if low > spec.max_replicas:
        errors["min_replicas"] = [f"{low} is above max_replicas {spec.max_replicas}"]
    elif not low <= replicas <= spec.max_replicas:
        errors["replicas"] = [f"{replicas} is outside autoscaling's bounds {low}..{spec.max_replicas}"]
    return errors


def spec_fields() -> dict[str, str]:
    """AutoscaleSpec's fields and the Deployment columns they are stored in."""
    return {
        "min_replicas": "min_replicas",
        "max_replicas": "max_replicas",
        "metric": "autoscale_metric",
        "target": "autoscale_target",
        "cooldown_s": "autoscale_cooldown_s",
    }


@dataclass(frozen=True)
class Decision:
    """How many replicas the autoscaler wants (the current count: no change) and why."""

    replicas: int
    reason: str


def autoscale_decide(*, current: int, values: list[float], spec: AutoscaleSpec) -> Decision:
    """The count for a deployment of ``current`` replicas whose ready ones
    report ``values`` of the metric; HPA's rule with Gantry's bounds."""
    low, high = spec.min_replicas or 1, spec.max_replicas or current
    mean = sum(values) / len(values)
    said = (
        f"{mean:.2f} {_METRIC_WORDS[spec.metric]} per ready replica ({len(values)}) against a target of {spec.target:g}"
    )
    ratio = mean / spec.target
    # Replicas wanted but not reporting yet (starting) count as HPA counts pods without
    # metrics: at 0 for a step up, at the target for a step down, so a replica still
    # starting is neither shrunk away nor doubled before its load is known.
    starting = max(0, current - len(values))
    total = sum(values) + (starting * spec.target if ratio < 1 else 0.0)
    counted = total / ((len(values) + starting) * spec.target)
    if abs(ratio - 1) <= TOLERANCE or abs(counted - 1) <= TOLERANCE or (counted - 1) * (ratio - 1) < 0:
        wanted = current
    else:
        wanted = math.ceil(total / spec.target)
    bounded = min(max(wanted, current - 1), current * 2)  # shrink by one, grow at most twofold
    final = min(max(bounded, low), high)
    notes = [f"{starting} replica(s) starting, counted at {'the target' if ratio < 1 else '0'}"] if starting else []
    if bounded != wanted:
        notes.append(f"the metric asks for {wanted}; a step grows at most twofold and shrinks by one")
    if final != bounded:
        notes.append(f"held within {low}..{high}")
    reason = said + (": " + "; ".join(notes) if notes else "")
    return Decision(replicas=final, reason=reason)


def deployments_autoscale(*, now: datetime | None = None) -> list[tuple[int, Decision]]:
    """Decide for every deployment with autoscaling on that is running, settled
    (ready or degraded) and out of its cooldown, and scale those whose count
    should change; the decisions made, by deployment id."""
    now = now or timezone.now()
    rows = Deployment.objects.filter(
        max_replicas__isnull=False,
        desired_state=DesiredState.RUNNING,
        status__in=[DeploymentStatus.READY, DeploymentStatus.DEGRADED],
    ).prefetch_related("replica_set__host")
    decided = []
    for deployment in rows:
        if deployment.scaled_at and now - deployment.scaled_at < timedelta(seconds=deployment.autoscale_cooldown_s):
            continue
        spec = AutoscaleSpec.of(deployment)
        values = [
            getattr(r, spec.metric)
            for r in deployment.replica_set.all()
            if r.desired_state == DesiredState.RUNNING and r.status in states.ANSWERING and r.host.is_online
        ]
        if not values:
            continue
        decision = autoscale_decide(current=deployment.replicas, values=values, spec=spec)
        if not _stable(deployment, decision, now):
            continue
        decided.append((deployment.pk, decision))
        try:
            replicas_service.deployment_scale(
                deployment_id=deployment.pk, replicas=decision.replicas, source=SOURCE, why=decision.reason,
                kind="deployment.autoscaled",
            )  # fmt: skip
        except (InvalidTransition, ValidationFailed) as exc:
            # Said once per cooldown, not on every sweep.
            with transaction.atomic():
                Deployment.objects.filter(pk=deployment.pk).update(scaled_at=now)
                events.record(
                    kind="deployment.autoscale_held", source=SOURCE, deployment=deployment,
                    message=f"wanted {decision.replicas} replicas ({decision.reason}) but could not: {exc}",
                )  # fmt: skip
    return decided


def _stable(deployment: Deployment, decision: Decision, now: datetime) -> bool:
    """Whether to act on ``decision``: a step up at once; a step down only once
    every decision for a whole cooldown has asked for fewer (Kubernetes HPA's
    scale-down stabilization), so a dip between requests, or the moment a new
    replica takes its share, does not remove a replica the load still needs."""
    lower = decision.replicas < deployment.replicas
    since = deployment.autoscale_low_since
    if not lower:
        if since is not None:
            Deployment.objects.filter(pk=deployment.pk).update(autoscale_low_since=None)
        return decision.replicas > deployment.replicas
    if since is None:
        Deployment.objects.filter(pk=deployment.pk).update(autoscale_low_since=now)
        return False
    return now - since >= timedelta(seconds=deployment.autoscale_cooldown_s)


def deployment_autoscale_set(*, deployment_id: int, spec: AutoscaleSpec, user: Any = None) -> Deployment:
    """Turn autoscaling on or off, or change its settings; a count outside the
    new bounds is moved inside them (a running deployment converges now)."""
    require_operator(user)
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        inside = deployment.replicas
        if spec.on:
            inside = min(max(deployment.replicas, spec.min_replicas or 1), spec.max_replicas)
        errors = autoscale_errors(spec, inside)
        if errors:
            raise ValidationFailed(errors)
        before = AutoscaleSpec.of(deployment)
        if before == spec:
            raise NothingToChange({"autoscale": "these are the deployment's settings already: nothing to change"})
        Deployment.objects.filter(pk=deployment_id).update(**spec.columns())
        words = describe(spec)
        events.record(
            kind="deployment.autoscale_set", source=events.source_of(user), actor=user, deployment=deployment,
            message=f"autoscaling: {words}", data={"before": asdict(before), "after": asdict(spec)},
        )  # fmt: skip
        if inside != deployment.replicas:
            if deployment.desired_state == DesiredState.RUNNING:
                return replicas_service.deployment_scale(
                    deployment_id=deployment_id, replicas=inside, source=events.source_of(user), actor=user,
                    why="moved inside autoscaling's new bounds",
                )  # fmt: skip
            Deployment.objects.filter(pk=deployment_id).update(replicas=inside)
    return Deployment.objects.get(pk=deployment_id)


def describe(spec: AutoscaleSpec) -> str:
    """Autoscaling's settings in words."""
    if not spec.on:
        return "off"
    return (
        f"{spec.min_replicas or 1}..{spec.max_replicas} replicas, holding {spec.target:g} "
        f"{_METRIC_WORDS[spec.metric]} per replica, {spec.cooldown_s}s between changes"
    )
