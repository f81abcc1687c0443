"""Gantry's domain: GPU hosts, registered checkpoints, engine builds,
deployments with their model placements, and the append-only event timeline.

Status fields are only ever changed through ``deployments.states`` and the
services; nothing here flips a status in ``save()`` or a signal.

Over 400 lines on purpose: Django wants an app's models in one module, and
every table of the domain is here, each with the choices and validators that
the serializers and forms derive from.
"""

from __future__ import annotations

import secrets
from datetime import timedelta

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

from deployments.fields import JSONField
from deployments.queues import host_queue, jobs_queue
from triton_server.names import engine_model

# Triton model names and host names end up in paths, queue names and URLs.
slug_validator = RegexValidator(
    r"^[a-z0-9][a-z0-9_.-]{0,62}$",
    "use 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit",
)

# The database's integers are 64-bit: a larger id in a body, a query or a form is
# refused by name (serializers and forms bound to it), never an OverflowError.
DB_INT_MAX = 2**63 - 1


class GpuHost(models.Model):
    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    address = models.CharField(
        max_length=255, blank=True, help_text="Where the web tier reaches this host's channel (GANTRY_HOST_ADDRESS)."
    )
    driver_version = models.CharField(max_length=64, blank=True)
    cuda_version = models.CharField(max_length=32, blank=True)
    agent_version = models.CharField(max_length=32, blank=True)
    nvml_error = models.CharField(max_length=255, blank=True, help_text="Why NVML gave no inventory, if so.")
    builders = JSONField(
        default=dict, blank=True,
        help_text='What this host can build with: {"images": {image: digest}, "native": tensorrt_llm version}.',
    )  # fmt: skip
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    offline_since = models.DateTimeField(
        null=True, blank=True, help_text="Set by the control plane's sweep when the host missed its beats."
    )
    broker_run_id = models.CharField(
        max_length=64, blank=True, help_text="The broker run this host's agent last saw (a change means a restart)."
    )
    channel_port = models.PositiveIntegerField(
        default=0, validators=[MaxValueValidator(65535)],
        help_text="Where its channel (mutual TLS to its Triton servers) listens on its address; "
        "0: none yet, or a host on loopback, whose servers are reached there.",
    )  # fmt: skip
    channel_request = models.TextField(
        blank=True, help_text="A certificate request (PEM) from the host's agent, waiting to be signed."
    )
    channel_proof = models.TextField(
        blank=True,
        help_text="The request signed with the host's current key (hex): a renewal, not a first certificate.",
    )
    channel_revoked = models.BooleanField(
        default=False, help_text="Its certificates are revoked: none is signed for it until it joins again."
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def is_online(self) -> bool:
        if self.last_heartbeat is None:
            return False
        allowed = settings.GANTRY_HEARTBEAT_INTERVAL * settings.GANTRY_HOST_OFFLINE_AFTER_BEATS
        return timezone.now() - self.last_heartbeat <= timedelta(seconds=allowed)

    @property
    def queue(self) -> str:
        return host_queue(self.name)

    @property
    def jobs_queue(self) -> str:
        return jobs_queue(self.name)


class ChannelAuthority(models.Model):
    """Gantry's certificate authority for the channel to GPU hosts (one row): its
    certificate and revocation list, which hosts read. Its key is in
    ChannelSecrets, which hosts cannot read."""

    certificate = models.TextField(help_text="The authority's certificate (PEM).")
    revocation_list = models.TextField(help_text="The current revocation list (PEM), signed by the authority.")
    revocation_number = models.PositiveBigIntegerField(default=1, help_text="Grows with every new revocation list.")
    revocation_signed_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"channel authority (revocation list {self.revocation_number})"


class ChannelSecrets(models.Model):
    """The authority's private key and the web tier's (one row). Withheld from
    hosts' database roles (deployments.host_access.WITHHELD_TABLES)."""

    authority_key = models.TextField()
    client_key = models.TextField(blank=True, help_text="The web tier's key; its certificate is a ChannelCertificate.")

    def __str__(self) -> str:
        return "channel secrets"


class ChannelCertificate(models.Model):
    """A certificate the authority signed: a host's (a TLS server) or, with no
    host, the web tier's (a TLS client)."""

    host = models.ForeignKey(
        GpuHost, null=True, blank=True, on_delete=models.CASCADE, related_name="certificates",
        help_text="The host it names; empty: the web tier's client certificate.",
    )  # fmt: skip
    serial = models.CharField(max_length=40, unique=True, help_text="Its serial number, in hex.")
    certificate = models.TextField(help_text="PEM.")
    not_after = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.host or 'web tier'} {self.serial}"


class HostJoinToken(models.Model):
    """A one-time secret with which one GPU host joins (``gantry join``); only its hash is kept."""

    token_sha256 = models.CharField(max_length=64, unique=True)
    host_name = models.CharField(
        max_length=63, blank=True, validators=[slug_validator], help_text="The host it is for; empty: any name."
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    used_by_host = models.CharField(max_length=63, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"join token for {self.host_name or 'any host'} ({'used' if self.used_at else 'unused'})"


class HostCredential(models.Model):
    """The database role and Redis user one joined host connects with, instead of
    the control plane's own. Their passwords are not kept: PostgreSQL keeps its
    own hash, and Redis is given the SHA-256 kept here again after a restart."""

    host = models.ForeignKey(GpuHost, on_delete=models.CASCADE, related_name="credentials")
    database_role = models.CharField(max_length=63, unique=True)
    redis_user = models.CharField(max_length=128, unique=True)
    redis_password_sha256 = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["host"], condition=models.Q(revoked_at=None), name="host_credential_one_active"
            )
        ]

    def __str__(self) -> str:
        return f"{self.host.name}: {self.database_role}{' (revoked)' if self.revoked_at else ''}"


class Gpu(models.Model):
    host = models.ForeignKey(GpuHost, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=64)
    name = models.CharField(max_length=128)
    compute_capability = models.CharField(max_length=8, help_text="major.minor, e.g. 9.0 for SM90")
    memory_total_bytes = models.BigIntegerField()
    memory_used_bytes = models.BigIntegerField(default=0)
    utilization_percent = models.PositiveSmallIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["host__name", "index"]
        constraints = [
            models.UniqueConstraint(fields=["host", "index"], name="gpu_unique_index_per_host"),
            models.UniqueConstraint(fields=["uuid"], name="gpu_unique_uuid"),
        ]

    def __str__(self) -> str:
        return f"{self.host.name}:{self.index} {self.name}"

    @property
    def sm(self) -> str:
        return "SM" + self.compute_capability.replace(".", "")


class ModelKind(models.TextChoices):
    LLM = "llm", "LLM (TensorRT-LLM)"
    EMBEDDING = "embedding", "Embedding"
    RERANKER = "reranker", "Reranker"
    PYTHON = "python", "Custom Python"


class Inspection(models.TextChoices):
    PENDING = "pending", "being inspected on its host"
    READY = "ready"
    FAILED = "failed"


class RegisteredModel(models.Model):
    """A HuggingFace-format checkpoint folder on a GPU host. The host that holds
    it inspects it (workers.tasks.inspect_model) and fills in what it found."""

    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    kind = models.CharField(max_length=16, choices=ModelKind.choices)
    host = models.ForeignKey(
        GpuHost, null=True, blank=True, on_delete=models.PROTECT, related_name="models",
        help_text="The host that holds the checkpoint and inspected it.",
    )  # fmt: skip
    path = models.CharField(max_length=1024, help_text="Checkpoint folder on the GPU hosts.")
    hub_id = models.CharField(max_length=255, blank=True, help_text="Where it came from, for the record.")
    revision = models.CharField(max_length=64, blank=True)
    inspection = models.CharField(max_length=16, choices=Inspection.choices, default=Inspection.PENDING)
    inspection_message = models.TextField(blank=True)
    architecture = models.CharField(max_length=128, blank=True)
    model_type = models.CharField(max_length=64, blank=True)
    parameter_count = models.BigIntegerField(null=True, blank=True, help_text="From the safetensors headers.")
    hidden_size = models.PositiveIntegerField(null=True, blank=True)
    num_layers = models.PositiveIntegerField(null=True, blank=True)
    num_attention_heads = models.PositiveIntegerField(null=True, blank=True)
    num_kv_heads = models.PositiveIntegerField(null=True, blank=True)
    head_dim = models.PositiveIntegerField(null=True, blank=True)
    vocab_size = models.PositiveIntegerField(null=True, blank=True)
    max_position_embeddings = models.PositiveIntegerField(null=True, blank=True)
    torch_dtype = models.CharField(max_length=32, blank=True)
    size_bytes = models.BigIntegerField(
        default=0, help_text="The weight files a loader reads (safetensors when present, not a .bin copy beside them)."
    )
    tokenizer_files = JSONField(default=list, blank=True)
    fingerprint = models.CharField(
        max_length=64, blank=True, help_text="sha256 over the checkpoint's files and contents."
    )
    config = JSONField(default=dict, help_text="The checkpoint's config.json as read.")
    trust_remote_code = models.BooleanField(
        default=False, help_text="Allow the checkpoint's own Python code (auto_map) to run on the host."
    )
    chat_template = models.TextField(blank=True, help_text="The Jinja chat template of its tokenizer files.")
    special_tokens = JSONField(default=dict, blank=True, help_text="bos_token, eos_token, ... as strings.")
    sentence_config = JSONField(
        default=dict,
        blank=True,
        help_text="The checkpoint's own sentence-transformers configuration (modules, pooling, normalisation, "
        "prompts, max_seq_length), as read; empty when it has none.",
    )
    notice = models.CharField(
        max_length=255, blank=True, help_text="What a user must know about it (e.g. untrained weights)."
    )
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class BuildStatus(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class BuildExecutor(models.TextChoices):
    DOCKER = "docker", "Docker (builder image)"
    NATIVE = "native", "Native (tensorrt_llm on the host)"


class EngineBuild(models.Model):
    """A TensorRT-LLM engine compiled from a registered checkpoint on one GPU host.

    The request (spec, image, host) is fixed when the row is created; the worker
    fills in what the build really used (TensorRT-LLM version, build and plugin
    config, image digest, GPU) and its artifacts. Only services change a build.
    """

    model = models.ForeignKey(RegisteredModel, on_delete=models.PROTECT, related_name="builds")
    host = models.ForeignKey(GpuHost, on_delete=models.PROTECT, related_name="builds")
    spec = JSONField(default=dict, help_text="The normalized build spec.")
    executor = models.CharField(max_length=16, choices=BuildExecutor.choices, default=BuildExecutor.DOCKER)
    builder_image = models.CharField(max_length=255, blank=True)
    image_digest = models.CharField(max_length=128, blank=True)
    trtllm_version = models.CharField(max_length=32, blank=True)
    gpu_name = models.CharField(max_length=128, blank=True)
    compute_capability = models.CharField(max_length=8, blank=True)
    gpu_ids = JSONField(default=list, blank=True, help_text="The host GPUs the build runs on.")
    tp_size = models.PositiveSmallIntegerField(default=1)
    pp_size = models.PositiveSmallIntegerField(default=1)
    cache_key = models.CharField(
        max_length=64, db_index=True, default="", help_text="sha256 of fingerprint, spec, image, GPU."
    )
    forced = models.BooleanField(default=False, help_text="Built although an identical engine existed.")
    time_limit_s = models.PositiveIntegerField(default=7200)
    status = models.CharField(max_length=16, choices=BuildStatus.choices, default=BuildStatus.PENDING)
    status_message = models.TextField(blank=True)
    phase = models.CharField(max_length=64, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    hint = models.TextField(blank=True)
    runtime_handle = models.CharField(max_length=128, blank=True, help_text="Container id or process group.")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    output_dir = models.CharField(max_length=1024, blank=True)
    artifacts = JSONField(default=list, blank=True, help_text="[{name, size, sha256}] of the engine folder.")
    files_missing = models.CharField(
        max_length=512,
        blank=True,
        help_text="What its host found gone or changed of a succeeded build's engine folder; such a build is "
        "never reused or served again.",
    )
    build_config = JSONField(default=dict, blank=True, help_text="build_config from the engine's config.json.")
    plugin_config = JSONField(default=dict, blank=True)
    engine_config = JSONField(default=dict, blank=True, help_text="The engine's config.json as written.")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        # The list pages newest first, filtered by status or model.
        indexes = [models.Index(fields=["status", "-id"]), models.Index(fields=["model", "-id"])]
        constraints = [
            # Two identical requests at the same moment start one build.
            models.UniqueConstraint(
                fields=["cache_key"],
                condition=models.Q(status__in=["pending", "running", "cancelling"]),
                name="one_active_build_per_cache_key",
            )
        ]

    def __str__(self) -> str:
        return f"build {self.pk} of {self.model.name}"

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def engine_size_bytes(self) -> int:
        return sum(a.get("size", 0) for a in self.artifacts if str(a.get("name", "")).endswith(".engine"))


class BuildLogLine(models.Model):
    """A line of a build's output, stored in batches (the newest GANTRY_BUILD_LOG_LINES are kept)."""

    build = models.ForeignKey(EngineBuild, on_delete=models.CASCADE, related_name="log_lines")
    at = models.DateTimeField(default=timezone.now)
    line = models.TextField()

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["build", "id"])]

    def __str__(self) -> str:
        return self.line[:80]


class DeploymentStatus(models.TextChoices):
    PENDING = "pending"
    LAUNCHING = "launching"
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
    desired_state = models.CharField(max_length=16, choices=DesiredState.choices, default=DesiredState.STOPPED)
    status = models.CharField(max_length=16, choices=DeploymentStatus.choices, default=DeploymentStatus.PENDING)
    status_message = models.TextField(blank=True)
    status_changed_at = models.DateTimeField(default=timezone.now)
    generation = models.PositiveIntegerField(default=1)
    # Server settings (restart to change): the container's /dev/shm (docker; Docker's own
    # default is 64 MB, the seeds use 16 GB) and Triton's --log-verbose level.
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
        "(Little's law on Triton's request duration), or those queued at the scrape if more.",
    )
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
        """What the UI shows: the recorded status, or "unknown" while the host is offline
        (its last report may be stale; nothing is torn down for that alone)."""
        if self.status in {DeploymentStatus.PENDING, DeploymentStatus.STOPPED, DeploymentStatus.LOST}:
            return self.status
        return self.status if self.host.is_online else "unknown"


class Backend(models.TextChoices):
    PYTHON = "python"
    TENSORRTLLM = "tensorrtllm", "tensorrtllm (an engine build)"
    LLM_API = "llmapi", "TensorRT-LLM LLM API (the checkpoint, no engine build)"
    TRANSFORMERS = "transformers", "HuggingFace transformers on the python backend (any Triton host)"


# The backends that generate text, all behind the same interface (text_input,
# max_tokens, sampling fields, stream -> text_output).
GENERATIVE_BACKENDS = frozenset({Backend.TENSORRTLLM, Backend.LLM_API, Backend.TRANSFORMERS})


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
    max_queue_delay_us = models.PositiveIntegerField(default=2000, validators=[MaxValueValidator(10_000_000)])
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

    @property
    def triton_models(self) -> list[str]:
        """The Triton models this placement becomes, in load order: an engine
        placement is its engine and the generate model clients call by the
        placement's name (as triton_server.config.TrtllmSpec.model_names)."""
        if self.backend == Backend.TENSORRTLLM:
            return [engine_model(self.triton_name), self.triton_name]
        return [self.triton_name]


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
