"""Load tests: one run of a load generator against one model of a deployment,
kept with what it measured and what it measured against."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q

from core.fields import JSONField
from deployments.models import Deployment
from hosts.models import GpuHost


class RunStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


# The only moves a run's status may make (loadtests.services.run_transition makes them).
ALLOWED: dict[str, frozenset[str]] = {
    RunStatus.QUEUED: frozenset({RunStatus.RUNNING, RunStatus.CANCELLED, RunStatus.FAILED}),
    RunStatus.RUNNING: frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLING}),
    RunStatus.CANCELLING: frozenset({RunStatus.CANCELLED, RunStatus.FAILED}),
}
ACTIVE = frozenset({RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.CANCELLING})
TERMINAL = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})


class LoadTest(models.Model):
    """A load test of one gateway alias. ``workload`` is the checked spec;
    ``context`` what was under test when it started (generation, builds,
    image, GPUs, versions), so a run stays readable after the deployment
    changes or is deleted."""

    deployment = models.ForeignKey(
        Deployment, null=True, blank=True, on_delete=models.SET_NULL, related_name="load_tests"
    )
    deployment_name = models.CharField(max_length=63)
    host = models.ForeignKey(
        GpuHost, null=True, blank=True, on_delete=models.SET_NULL, related_name="load_tests",
        help_text="Where the load generator runs: the host of the deployment's first ready replica.",
    )  # fmt: skip
    alias = models.CharField(max_length=128, help_text="The gateway model name the load went to.")
    triton_name = models.CharField(max_length=63)
    kind = models.CharField(max_length=16, help_text="llm, embedding or reranker")
    workload = JSONField(help_text="The checked workload (loadtests.workload).")
    context = JSONField(default=dict, help_text="What was under test: generation, builds, image, GPUs.")
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.QUEUED)
    status_message = models.TextField(blank=True)
    progress = JSONField(default=dict, blank=True, help_text="The step under way, for the page.")
    log_tail = models.TextField(blank=True, help_text="The load generator's last lines.")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["deployment", "-id"])]
        constraints = [
            # One run at a time per deployment: the database says so, not a check that can race.
            models.UniqueConstraint(
                fields=["deployment"],
                condition=Q(status__in=["queued", "running", "cancelling"]),
                name="one_active_load_test_per_deployment",
            )
        ]

    def __str__(self) -> str:
        return f"load test {self.pk} of {self.alias} ({self.status})"


class LoadPoint(models.Model):
    """One step of a run: one load level against one target (the gateway,
    Triton directly, or the engine under trtllm-bench with no server), with
    the generator's figures, its per-request records and the server's own
    metrics over the same minutes."""

    class Target(models.TextChoices):
        GATEWAY = "gateway"
        TRITON = "triton"
        NATIVE = "native", "native (trtllm-bench)"

    run = models.ForeignKey(LoadTest, on_delete=models.CASCADE, related_name="points")
    target = models.CharField(max_length=8, choices=Target.choices)
    level = models.FloatField(help_text="Concurrency, or requests per second.")
    complete = models.BooleanField(default=True, help_text="False when the step was cut short.")
    summary = JSONField(default=dict, help_text="Throughput, latency percentiles, goodput, errors.")
    records = JSONField(default=list, help_text="One compact record per request.")
    server = JSONField(default=dict, help_text="Triton's metrics sampled during the step.")
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()

    class Meta:
        ordering = ["run", "target", "level"]
        constraints = [models.UniqueConstraint(fields=["run", "target", "level"], name="one_point_per_level")]

    def __str__(self) -> str:
        return f"{self.run_id} {self.target} @ {self.level:g}"


class TuningRun(models.Model):
    """A search over a deployment's settings under a mixed load: each trial is
    a generation the per-GPU plan accepts, load-tested at the mix's rates on
    every alias at once and scored by goodput under the targets
    (loadtests.tuning). ``start_generation`` is what cancel and the end of the
    search put back; "apply" makes the chosen trial's plan the next one."""

    deployment = models.ForeignKey(
        Deployment, null=True, blank=True, on_delete=models.SET_NULL, related_name="tuning_runs"
    )
    deployment_name = models.CharField(max_length=63)
    host = models.ForeignKey(
        GpuHost, null=True, blank=True, on_delete=models.SET_NULL, related_name="tuning_runs",
        help_text="Where the load generators run: the host of the deployment's first ready replica.",
    )  # fmt: skip
    spec = JSONField(help_text="The checked mix, targets, search space and budget (loadtests.tuning).")
    start_generation = models.PositiveIntegerField(help_text="The generation the run started from.")
    start_plan = JSONField(default=list, help_text="That generation's placements, as its revision holds them.")
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.QUEUED)
    status_message = models.TextField(blank=True)
    progress = JSONField(default=dict, blank=True, help_text="The trial under way, for the page.")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    applied_generation = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="The generation holding this run's chosen trial: made by 'apply', or by the run's end (end_on best).",
    )
    restore_pending = models.BooleanField(
        default=False,
        help_text="The run ended without the settings it ends on in place (its deployment could not take a "
        "change then): the beat tries again until they are, and the run holds the deployment until then.",
    )
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["deployment"],
                condition=Q(status__in=["queued", "running", "cancelling"]),
                name="one_active_tuning_run_per_deployment",
            )
        ]

    def __str__(self) -> str:
        return f"tuning run {self.pk} of {self.deployment_name} ({self.status})"


class TrialStatus(models.TextChoices):
    RUNNING = "running"
    MEASURED = "measured"
    PRUNED = "pruned", "pruned (does not fit)"
    FAILED = "failed", "failed (did not load or measure)"


class TuningTrial(models.Model):
    """One point of a tuning run's search: the settings it tried, the plan
    they made, and how it scored or why it did not."""

    run = models.ForeignKey(TuningRun, on_delete=models.CASCADE, related_name="trials")
    number = models.PositiveIntegerField(help_text="0, 1, ...: the optimiser's trial number.")
    params = JSONField(help_text='The knobs\' values: {"<model>.<field>": value}.')
    plan = JSONField(default=list, help_text="The placements the values make (a generation's spec).")
    status = models.CharField(max_length=16, choices=TrialStatus.choices, default=TrialStatus.RUNNING)
    reason = models.TextField(blank=True, help_text="Why it was pruned or failed.")
    generation = models.PositiveIntegerField(null=True, blank=True)
    gpu_share = models.FloatField(
        default=0.0, help_text="GPU memory the plan holds: the sum of its GPU placements' shares, in GPUs."
    )
    figures = JSONField(default=dict, blank=True, help_text="Per alias: rate, p99s against targets, goodput.")
    goodput = models.FloatField(null=True, blank=True, help_text="Requests/s meeting every target, all aliases.")
    started_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run", "number"]
        constraints = [models.UniqueConstraint(fields=["run", "number"], name="one_trial_per_number")]

    def __str__(self) -> str:
        return f"trial {self.number} of tuning run {self.run_id} ({self.status})"
