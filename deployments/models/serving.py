"""Deployments: their replicas (one Triton on one host each), model placements
and generations."""

from __future__ import annotations

import secrets

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone

from core.fields import JSONField
from core.validation import slug_validator
from deployments.models.checkpoints import EngineBuild, RegisteredModel
from hosts.models import GpuHost


class DeploymentStatus(models.TextChoices):
    PENDING = "pending"
    LAUNCHING = "launching"
    FETCHING = "fetching"  # a replica's host downloading a hub model it lacks, before it starts the server
    LOADING = "loading"
    READY = "ready"
    UPDATING = "updating"  # a ready deployment loading its new generation in place
    DEGRADED = "degraded"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    LOST = "lost"  # a replica whose host stopped beating for the grace period


class DesiredState(models.TextChoices):
    RUNNING = "running"
    STOPPED = "stopped"


class Runtime(models.TextChoices):
    PROCESS = "process", "Local tritonserver process"
    DOCKER = "docker", "Docker container"


def new_admin_secret() -> str:
    return secrets.token_urlsafe(32)


class PlacementPolicy(models.TextChoices):
    SPREAD = "spread", "Spread across hosts"
    PACK = "pack", "Pack onto the fewest hosts"


class AutoscaleMetric(models.TextChoices):
    IN_FLIGHT = "in_flight", "Requests in flight per replica"
    QUEUE_MS = "queue_ms", "Queue time per request (ms)"


class Deployment(models.Model):
    """What to serve: placements (models with their fractions and batching),
    server settings and how many replicas. Each replica is one Triton on one
    host (Replica); the deployment's status sums up theirs."""

    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    runtime = models.CharField(max_length=16, choices=Runtime.choices, default=Runtime.PROCESS)
    image = models.CharField(max_length=255, blank=True, help_text="Triton image (docker runtime only).")
    replicas = models.PositiveSmallIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(64)],
        help_text="How many Triton servers serve the placements, each on a host and GPUs Gantry chooses.",
    )  # fmt: skip
    placement_policy = models.CharField(
        max_length=8, choices=PlacementPolicy.choices, default=PlacementPolicy.SPREAD,
        help_text="spread: replicas on different hosts where they fit; pack: onto the fewest hosts.",
    )  # fmt: skip
    physical_gpus = models.BooleanField(
        default=False,
        help_text="The placements' gpu_ids are each host's own GPU indexes, as CUDA_VISIBLE_DEVICES pins a process: "
        "never mapped onto other GPUs; a host where those GPUs lack room takes no replica.",
    )
    pinned_hosts = models.ManyToManyField(
        GpuHost, blank=True, related_name="pinned_deployments",
        help_text="The hosts replicas may run on (none: any online host with room).",
    )  # fmt: skip
    # Autoscaling is on while max_replicas is set: the control plane's sweep moves
    # ``replicas`` between the bounds (deployments.services.autoscale).
    min_replicas = models.PositiveSmallIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1), MaxValueValidator(64)],
        help_text="Autoscaling's floor (with max_replicas).",
    )  # fmt: skip
    max_replicas = models.PositiveSmallIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1), MaxValueValidator(64)],
        help_text="Autoscaling's ceiling; empty: autoscaling off.",
    )  # fmt: skip
    autoscale_metric = models.CharField(
        max_length=16, choices=AutoscaleMetric.choices, default=AutoscaleMetric.IN_FLIGHT,
        help_text="What autoscaling holds at its target, per replica.",
    )  # fmt: skip
    autoscale_target = models.FloatField(
        default=4.0, validators=[MinValueValidator(0.1), MaxValueValidator(100_000)],
        help_text="The metric's value per replica that autoscaling aims for.",
    )  # fmt: skip
    autoscale_cooldown_s = models.PositiveIntegerField(
        default=60, validators=[MinValueValidator(5), MaxValueValidator(86_400)],
        help_text="Seconds after any change of the replica count before autoscaling changes it again.",
    )  # fmt: skip
    scaled_at = models.DateTimeField(null=True, blank=True, help_text="When the replica count last changed.")
    autoscale_low_since = models.DateTimeField(
        null=True, blank=True,
        help_text="Since when every autoscaling decision has asked for fewer replicas (a step down waits a whole "
        "cooldown of them: HPA's scale-down stabilization).",
    )  # fmt: skip
    desired_state = models.CharField(max_length=16, choices=DesiredState.choices, default=DesiredState.STOPPED)
    status = models.CharField(max_length=16, choices=DeploymentStatus.choices, default=DeploymentStatus.PENDING)
    status_message = models.TextField(blank=True)
    status_changed_at = models.DateTimeField(default=timezone.now)
    generation = models.PositiveIntegerField(default=1)
    # Server settings (restart to change): the container's /dev/shm (docker; Docker's own
    # default is 64 MB, the seeds use 16 GB) and Triton's --log-verbose level.
    drain_timeout_s = models.PositiveIntegerField(
        default=30, validators=[MaxValueValidator(3600)],
        help_text="How long a replica being retired (scale-down, a roll, a stop) keeps answering the requests it "
        "holds, out of balancing, before its server is stopped (0: stopped at once).",
    )  # fmt: skip
    shm_size_mib = models.PositiveIntegerField(
        default=2048, validators=[MinValueValidator(64), MaxValueValidator(1_048_576)],
        help_text="The container's shared memory (/dev/shm) in MiB; the docker runtime only.",
    )  # fmt: skip
    log_verbose = models.PositiveSmallIntegerField(
        default=0, validators=[MaxValueValidator(5)], help_text="tritonserver --log-verbose (0: off)."
    )
    # Triton has no users: its model-repository and logging APIs answer only
    # requests carrying this secret (--http-restricted-api). Never shown.
    admin_secret = models.CharField(max_length=64, default=new_admin_secret, editable=False)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def shown_status(self) -> str:
        """What the UI shows: the recorded status, or "unknown" while every host
        that carries one of its servers is offline (their last reports may be
        stale; nothing is torn down for that alone before the grace period)."""
        if self.status in {DeploymentStatus.PENDING, DeploymentStatus.STOPPED}:
            return self.status
        carrying = [r for r in self.replica_set.all() if r.status not in {DeploymentStatus.STOPPED}]
        if carrying and not any(r.host.is_online for r in carrying):
            return "unknown"
        return self.status


class Replica(models.Model):
    """One Triton server of a deployment, on one host: the unit a host's worker
    launches, watches and stops. Its GPUs are the deployment's GPUs (as its
    placements number them, from 0) mapped onto the host's."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="replica_set")
    serial = models.PositiveIntegerField(help_text="r1, r2, ...: never reused within the deployment.")
    host = models.ForeignKey(GpuHost, on_delete=models.PROTECT, related_name="replicas")
    gpu_map = JSONField(
        default=dict, blank=True, help_text='The deployment\'s GPU numbers to this host\'s: {"0": 3, "1": 5}.'
    )
    http_port = models.PositiveIntegerField(validators=[MinValueValidator(1024), MaxValueValidator(65535)])
    grpc_port = models.PositiveIntegerField(validators=[MinValueValidator(1024), MaxValueValidator(65535)])
    metrics_port = models.PositiveIntegerField(validators=[MinValueValidator(1024), MaxValueValidator(65535)])
    generation = models.PositiveIntegerField(help_text="The deployment's generation this replica serves.")
    plan = JSONField(
        default=dict, blank=True,
        help_text="What it runs, resolved when the control plane sends its launch or generation: each "
        "placement's host GPUs, instances, KV-cache budget and lengths (deployments.backends.replica_plan).",
    )  # fmt: skip
    desired_state = models.CharField(max_length=16, choices=DesiredState.choices, default=DesiredState.RUNNING)
    status = models.CharField(max_length=16, choices=DeploymentStatus.choices, default=DeploymentStatus.PENDING)
    status_message = models.TextField(blank=True)
    status_changed_at = models.DateTimeField(default=timezone.now)
    models_ready = JSONField(
        default=dict, blank=True, help_text="Triton's readiness of each model at the host agent's last check."
    )
    queue_ms = models.FloatField(
        default=0.0, help_text="The longest mean queue time of its models at the last scrape (balancing's tie-breaker)."
    )
    in_flight = models.FloatField(
        default=0.0,
        help_text="Requests in its Triton, queued and executing: the mean over the last scrape interval "
        "(Little's law on Triton's request duration), or those held at the scrape if more (queued in Triton, "
        "or streams a generating model holds).",
    )
    threads = models.PositiveSmallIntegerField(
        null=True, blank=True,
        help_text="The CPU threads each of its model processes may use, set by its host as its server starts: its "
        "share of the host's cores (workers.deploy.plan.replica_threads).",
    )  # fmt: skip
    drain_until = models.DateTimeField(
        null=True, blank=True,
        help_text="Stopping: its server answers the requests it holds until they end or this time comes; "
        "cleared once drained (none: stopped at once).",
    )  # fmt: skip
    # Where the runtime can find what it started: a process id or a container id.
    # Cleared when the server is gone.
    runtime_handle = models.CharField(max_length=128, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["deployment", "serial"]
        constraints = [
            models.UniqueConstraint(fields=["deployment", "serial"], name="replica_unique_serial"),
            models.UniqueConstraint(fields=["host", "http_port"], name="replica_unique_http_port"),
            models.UniqueConstraint(fields=["host", "grpc_port"], name="replica_unique_grpc_port"),
            models.UniqueConstraint(fields=["host", "metrics_port"], name="replica_unique_metrics_port"),
        ]
        indexes = [models.Index(fields=["host", "status"])]

    def __str__(self) -> str:
        return f"{self.deployment_id} r{self.serial} on {self.host_id}"

    @property
    def label(self) -> str:
        return f"r{self.serial}"

    @property
    def gpus(self) -> dict[int, int]:
        return {int(logical): index for logical, index in self.gpu_map.items()}

    @property
    def shown_status(self) -> str:
        """What the UI shows: the recorded status ("draining" while a stopping one
        still answers what it holds), or "unknown" while the host is offline (its
        last report may be stale; nothing is torn down for that alone)."""
        if self.status in {DeploymentStatus.PENDING, DeploymentStatus.STOPPED, DeploymentStatus.LOST}:
            return self.status
        if not self.host.is_online:
            return "unknown"
        return "draining" if self.is_draining else self.status

    @property
    def is_draining(self) -> bool:
        return self.status == DeploymentStatus.STOPPING and self.drain_until is not None


class Backend(models.TextChoices):
    PYTHON = "python"
    TENSORRTLLM = "tensorrtllm", "tensorrtllm (an engine build)"
    LLM_API = "llmapi", "TensorRT-LLM LLM API (the checkpoint, no engine build)"
    TRANSFORMERS = "transformers", "HuggingFace transformers on the python backend (any Triton host)"


class SchedulerPolicy(models.TextChoices):
    GUARANTEED_NO_EVICT = "guaranteed_no_evict"
    MAX_UTILIZATION = "max_utilization"


class Dtype(models.TextChoices):
    AUTO = "auto", "auto (16-bit on a GPU, float32 on a CPU)"
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class DecodingMode(models.TextChoices):
    """tensorrtllm_backend's decoding_mode (speculative modes need engines Gantry does not build)."""

    AUTO = "", "auto (top_k_top_p, or beam_search with beams)"
    TOP_K = "top_k"
    TOP_P = "top_p"
    TOP_K_TOP_P = "top_k_top_p"
    BEAM_SEARCH = "beam_search"


class TimeoutAction(models.TextChoices):
    """What Triton's queue does with a request past queue_timeout_us (ModelQueuePolicy)."""

    REJECT = "REJECT"
    DELAY = "DELAY"


class InstanceKind(models.TextChoices):
    AUTO = "auto", "GPU when the host has one, else CPU"
    CPU = "KIND_CPU"
    GPU = "KIND_GPU"


class DeploymentModel(models.Model):
    """One model placed in a deployment's Triton model repository."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="placements")
    triton_name = models.CharField(max_length=63, validators=[slug_validator])
    registered_model = models.ForeignKey(RegisteredModel, on_delete=models.PROTECT, related_name="placements")
    engine_build = models.ForeignKey(
        EngineBuild, null=True, blank=True, on_delete=models.PROTECT, related_name="placements"
    )
    backend = models.CharField(max_length=16, choices=Backend.choices, default=Backend.PYTHON)
    max_batch_size = models.PositiveIntegerField(default=32, validators=[MinValueValidator(1), MaxValueValidator(4096)])
    preferred_batch_sizes = JSONField(default=list, blank=True)
    max_queue_delay_us = models.PositiveIntegerField(
        default=2000,
        validators=[MaxValueValidator(10_000_000)],
        help_text="microseconds Triton's batcher holds a request to fill a batch; unset: 0 for an LLM (it batches "
        "in flight), 2000 for the others",
    )
    # Triton's dynamic batcher queue: priority levels (0 = one queue) and the
    # default queue policy (a request waiting longer than the timeout is
    # rejected; 0 = no timeout; max queue size 0 = unbounded).
    priority_levels = models.PositiveSmallIntegerField(default=0, validators=[MaxValueValidator(16)])
    default_priority_level = models.PositiveSmallIntegerField(default=0, validators=[MaxValueValidator(16)])
    queue_timeout_us = models.PositiveBigIntegerField(default=0, validators=[MaxValueValidator(3_600_000_000)])
    max_queue_size = models.PositiveIntegerField(default=0, validators=[MaxValueValidator(1_000_000)])
    timeout_action = models.CharField(max_length=8, choices=TimeoutAction.choices, default=TimeoutAction.REJECT)
    instance_count = models.PositiveSmallIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(64)]
    )
    instance_kind = models.CharField(max_length=16, choices=InstanceKind.choices, default=InstanceKind.AUTO)
    gpu_ids = JSONField(default=list, blank=True)
    gpu_memory_fraction = models.FloatField(default=0.1, validators=[MinValueValidator(0.01), MaxValueValidator(1.0)])
    # Python-backend models (sentence models and the transformers LLM).
    dtype = models.CharField(max_length=16, choices=Dtype.choices, default=Dtype.AUTO)
    max_seq_len = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(8), MaxValueValidator(1_048_576)],
        help_text="Tokens one input may hold: a text or query-passage pair (longer is truncated), or an llm "
        "prompt with its output (longer is refused). Empty: the checkpoint's own.",
    )  # fmt: skip
    max_num_sequences = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1), MaxValueValidator(4096)],
        help_text="An llm's sequences generating at once (transformers; the LLM API's max_batch_size). "
        "Empty: max_batch_size.",
    )  # fmt: skip
    # TensorRT-LLM placements only.
    batch_scheduler_policy = models.CharField(
        max_length=24, choices=SchedulerPolicy.choices, default=SchedulerPolicy.GUARANTEED_NO_EVICT
    )
    decoupled = models.BooleanField(default=True, help_text="Stream tokens as they are generated.")
    kv_cache_free_gpu_mem_fraction = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0.01), MaxValueValidator(1.0)],
        help_text="Of the memory left after the weights, the share for the KV cache (TensorRT-LLM's own "
        "parameter). Empty: 0.9.",
    )  # fmt: skip
    max_tokens_in_paged_kv_cache = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)],
        help_text="An absolute KV-cache budget in tokens, instead of the one planned from the fraction.",
    )  # fmt: skip
    enable_kv_cache_reuse = models.BooleanField(default=False, help_text="Reuse KV blocks of shared prompt prefixes.")
    decoding_mode = models.CharField(max_length=16, choices=DecodingMode.choices, default=DecodingMode.AUTO, blank=True)
    kv_cache_tokens = models.PositiveIntegerField(
        null=True, blank=True, help_text="max_tokens_in_paged_kv_cache as planned (or asked) for this placement."
    )
    ready = models.BooleanField(
        null=True,
        blank=True,
        help_text="Whether Triton has this model ready on every serving replica, at their agents' last checks "
        "(null: never checked).",
    )

    class Meta:
        ordering = ["triton_name"]
        constraints = [
            models.UniqueConstraint(fields=["deployment", "triton_name"], name="placement_unique_name"),
        ]

    def __str__(self) -> str:
        return f"{self.deployment.name}/{self.triton_name}"


class RevisionStatus(models.TextChoices):
    CURRENT = "current"  # the placements the deployment holds now
    SUPERSEDED = "superseded"  # an earlier generation that was current once
    FAILED = "failed"  # did not load; the deployment rolled back


class DeploymentRevision(models.Model):
    """What each generation of a deployment held: its placements, as a spec."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="revisions")
    generation = models.PositiveIntegerField()
    spec = JSONField(help_text="The placements of this generation.")
    status = models.CharField(max_length=16, choices=RevisionStatus.choices, default=RevisionStatus.CURRENT)
    message = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["deployment", "generation"]
        constraints = [
            models.UniqueConstraint(fields=["deployment", "generation"], name="revision_unique_generation"),
        ]

    def __str__(self) -> str:
        return f"{self.deployment_id} generation {self.generation} ({self.status})"
