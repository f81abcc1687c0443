"""What a deployment's replicas report: metric samples and log lines."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from core.fields import JSONField
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
