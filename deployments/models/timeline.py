"""What happened and what is to be sent: metric samples, log lines, the
append-only event timeline and the outbox."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from core.fields import JSONField
from deployments.models.checkpoints import EngineBuild, RegisteredModel
from deployments.models.hosts import GpuHost
from deployments.models.serving import Deployment, Replica


class MetricSample(models.Model):
    """One scrape's derived figures for one model or GPU of a deployment; pruned after the retention window."""

    class Kind(models.TextChoices):
        MODEL = "model"
        GPU = "gpu"

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="metric_samples")
    replica = models.ForeignKey(Replica, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    at = models.DateTimeField(default=timezone.now)
    kind = models.CharField(max_length=8, choices=Kind.choices)
    subject = models.CharField(max_length=128, help_text="Triton model name or GPU uuid")
    values = JSONField(default=dict)

    class Meta:
        ordering = ["at", "id"]
        indexes = [
            models.Index(fields=["deployment", "at"]),
            # The dashboard's sparklines: every deployment's model samples of the last minutes.
            models.Index(fields=["kind", "at"], name="metric_kind_at"),
        ]

    def __str__(self) -> str:
        return f"{self.deployment_id} {self.kind}:{self.subject} @ {self.at:%H:%M:%S}"


class LogLine(models.Model):
    """The recent lines of a deployment's Triton log, shipped by its host agent."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="log_lines")
    replica = models.ForeignKey(Replica, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    at = models.DateTimeField(default=timezone.now)
    line = models.TextField()

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["deployment", "id"])]

    def __str__(self) -> str:
        return self.line[:80]


class EventQuerySet(models.QuerySet):
    def update(self, **kwargs):  # noqa: ANN003, ANN201 - Django's signature
        raise TypeError("events are append-only")


class Event(models.Model):
    """Append-only timeline of everything that happened, and who did it."""

    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    source = models.CharField(max_length=128, help_text="user:<name>, worker:<host> or system")
    kind = models.CharField(max_length=64)
    # The timeline outlives what it tells of: deleting an object unlinks its events.
    deployment = models.ForeignKey(Deployment, null=True, blank=True, on_delete=models.SET_NULL, related_name="events")
    host = models.ForeignKey(GpuHost, null=True, blank=True, on_delete=models.SET_NULL, related_name="events")
    build = models.ForeignKey(EngineBuild, null=True, blank=True, on_delete=models.SET_NULL, related_name="events")
    model = models.ForeignKey(RegisteredModel, null=True, blank=True, on_delete=models.SET_NULL, related_name="events")
    from_status = models.CharField(max_length=16, blank=True)
    to_status = models.CharField(max_length=16, blank=True)
    message = models.TextField(blank=True)
    data = JSONField(default=dict, blank=True)

    objects = EventQuerySet.as_manager()

    class Meta:
        ordering = ["created_at", "id"]
        # Each timeline pages newest first by id; without these PostgreSQL
        # sorted all of a deployment's events on every page.
        indexes = [
            models.Index(fields=["deployment", "-id"]),
            models.Index(fields=["build", "-id"]),
            models.Index(fields=["host", "-id"]),
            models.Index(fields=["model", "-id"]),
            models.Index(fields=["kind", "-id"]),
        ]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.kind} {self.message[:60]}"

    def save(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        if self.pk is not None:
            raise TypeError("events are append-only")
        super().save(*args, **kwargs)


class OutboxMessage(models.Model):
    """A task for a host's worker, written in the same transaction as the change
    that asks for it (deployments.outbox). It is deleted once the broker has
    taken it; while the broker is unreachable it waits here, so an outage delays
    work and never loses it."""

    task = models.CharField(max_length=100)
    queue = models.CharField(max_length=80)
    args = JSONField(default=list)
    created_at = models.DateTimeField(default=timezone.now)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.CharField(max_length=255, blank=True)
    parked_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the broker, answering, refused this message itself PARK_AFTER times: it is kept here "
        "and on the timeline, and never sent again.",
    )

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["queue", "id"])]

    def __str__(self) -> str:
        return f"{self.task}{tuple(self.args)} for {self.queue}"
