"""The append-only event timeline: what happened to a deployment, a build, a
model or a host, and who did it. It sits in core because every domain app
records on it (core.events); its rows name theirs by lazy reference, so core
imports none of them."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from core.fields import JSONField


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
    deployment = models.ForeignKey(
        "deployments.Deployment", null=True, blank=True, on_delete=models.SET_NULL, related_name="events"
    )
    host = models.ForeignKey("hosts.GpuHost", null=True, blank=True, on_delete=models.SET_NULL, related_name="events")
    build = models.ForeignKey(
        "deployments.EngineBuild", null=True, blank=True, on_delete=models.SET_NULL, related_name="events"
    )
    model = models.ForeignKey(
        "deployments.RegisteredModel", null=True, blank=True, on_delete=models.SET_NULL, related_name="events"
    )
    from_status = models.CharField(max_length=16, blank=True)
    to_status = models.CharField(max_length=16, blank=True)
    message = models.TextField(blank=True)
    data = JSONField(default=dict, blank=True)

    objects = EventQuerySet.as_manager()

    class Meta:
        db_table = "deployments_event"  # made by the deployments app, where it lived before core
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
