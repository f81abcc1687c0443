"""Registered checkpoints and the engine builds made from them."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.db import models
from django.utils import timezone

from core.fields import JSONField
from core.validation import slug_validator
from hosts.models import GpuHost


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
    """A HuggingFace-format checkpoint: a folder on a GPU host, or a hub
    repository at a revision that hosts download into their own cache
    (ModelDownload). The host that holds it first inspects it
    (workers.tasks.inspect_model) and fills in what it found."""

    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    kind = models.CharField(max_length=16, choices=ModelKind.choices)
    host = models.ForeignKey(
        GpuHost, null=True, blank=True, on_delete=models.PROTECT, related_name="models",
        help_text="The host that holds the checkpoint and inspected it.",
    )  # fmt: skip
    path = models.CharField(
        max_length=1024, blank=True,
        help_text="Checkpoint folder on the GPU hosts; empty for a model downloaded from the hub (each host keeps "
        "it in its own GANTRY_HUB_CACHE).",
    )  # fmt: skip
    hub_id = models.CharField(
        max_length=255, blank=True,
        help_text="The hub repository: downloaded from there when no path is given, else where the folder came from.",
    )  # fmt: skip
    revision = models.CharField(max_length=255, blank=True, help_text="The branch, tag or commit asked for.")
    commit = models.CharField(
        max_length=40, blank=True,
        help_text="The commit the revision pointed at when the model was first downloaded: every host gets this one.",
    )  # fmt: skip
    allow_patterns = JSONField(default=list, blank=True, help_text="Only files matching one of these are downloaded.")
    ignore_patterns = JSONField(default=list, blank=True, help_text="Files matching one of these are not downloaded.")
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

    @property
    def downloaded(self) -> bool:
        """Hosts download it from the hub (it has no folder of its own)."""
        return not self.path

    @property
    def fetchable(self) -> bool:
        """A host that lacks it may download it before serving it: a hub model
        inspected already, so its commit is pinned."""
        return self.downloaded and bool(self.commit) and self.inspection == Inspection.READY

    @property
    def folder(self) -> Path:
        """Where the checkpoint is on this host: its path, or its snapshot in this
        host's hub cache (known once its revision is resolved to a commit)."""
        if not self.downloaded:
            return Path(self.path)
        return hub_snapshot(Path(settings.GANTRY_HUB_CACHE), self.hub_id, self.commit or "unresolved")


def hub_snapshot(cache: Path, hub_id: str, commit: str) -> Path:
    """A hub repository's files at ``commit`` in a cache of the hub's own layout
    (what huggingface_hub's snapshot download returns for it)."""
    return cache / ("models--" + hub_id.replace("/", "--")) / "snapshots" / commit


class CheckpointCopy(models.Model):
    """A registered checkpoint's folder as one host holds it: found at the
    model's path by that host's agent (workers.deploy.copies), with the
    fingerprint of what it found there. Placement sends a replica only to hosts
    whose copy matches the registered fingerprint
    (deployments.services.replica_placement.holding_hosts)."""

    model = models.ForeignKey(RegisteredModel, on_delete=models.CASCADE, related_name="copies")
    host = models.ForeignKey(GpuHost, on_delete=models.CASCADE, related_name="checkpoint_copies")
    fingerprint = models.CharField(max_length=64, help_text="sha256 over the files this host found at the path.")
    checked_at = models.DateTimeField(
        default=timezone.now, help_text="Since when the host has held the files as they are (found, or changed)."
    )
    used_at = models.DateTimeField(
        null=True, blank=True, help_text="When a replica last launched with it here (its hub cache evicts the least "
        "recently used first)."
    )  # fmt: skip
    # db_default too: a host still on the previous release inserts copies without this column.
    pinned = models.BooleanField(
        default=False, db_default=False,
        help_text="Never evicted from this host's hub cache (a model downloaded from the hub).",
    )  # fmt: skip

    class Meta:
        constraints = [models.UniqueConstraint(fields=["model", "host"], name="one_copy_per_model_and_host")]

    def __str__(self) -> str:
        return f"{self.model} on {self.host}"

    @property
    def matches(self) -> bool:
        """The files are the ones registered (a copy that differs is never served)."""
        return self.fingerprint == self.model.fingerprint


class DownloadStatus(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ModelDownload(models.Model):
    """One host downloading a hub model into its cache (workers.downloads), with
    its progress. A job like a build: the row exists before its task, and only
    deployments.states moves its status."""

    model = models.ForeignKey(RegisteredModel, on_delete=models.CASCADE, related_name="downloads")
    host = models.ForeignKey(GpuHost, on_delete=models.CASCADE, related_name="downloads")
    status = models.CharField(max_length=16, choices=DownloadStatus.choices, default=DownloadStatus.PENDING)
    status_message = models.TextField(blank=True)
    commit = models.CharField(max_length=40, blank=True, help_text="The commit downloaded.")
    files_total = models.PositiveIntegerField(default=0)
    files_done = models.PositiveIntegerField(default=0)
    bytes_total = models.BigIntegerField(default=0)
    bytes_done = models.BigIntegerField(default=0, help_text="Bytes on the host's disk, resumed ones included.")
    rate_bps = models.BigIntegerField(default=0, help_text="Bytes a second over the last few seconds.")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "host"],
                condition=models.Q(status__in=["pending", "running", "cancelling"]),
                name="one_active_download_per_model_and_host",
            )
        ]

    def __str__(self) -> str:
        return f"download {self.pk} of {self.model} on {self.host}"

    @property
    def is_first(self) -> bool:
        """The model's first download, on the host that registered it (which then inspects it)."""
        return self.model.inspection == Inspection.PENDING and self.model.host_id == self.host_id

    @property
    def eta_s(self) -> int | None:
        """Seconds left at the current rate; None when nothing is moving."""
        if self.status != DownloadStatus.RUNNING or self.rate_bps <= 0:
            return None
        return max(0, self.bytes_total - self.bytes_done) // self.rate_bps


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
