"""GPU hosts: their GPUs, how they joined (tokens and credentials), the
channel's authority and certificates, and the outbox of tasks for them.

The tables keep the names they were made with in the deployments app (each
Meta.db_table): the move to this app changed no schema."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.core.validators import MaxValueValidator
from django.db import models
from django.utils import timezone

from core.fields import JSONField
from core.queues import host_queue, jobs_queue
from core.validation import slug_validator


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
        db_table = "deployments_gpuhost"
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
    def is_cordoned(self) -> bool:
        return Cordon.objects.filter(host_id=self.pk).exists()

    @property
    def jobs_queue(self) -> str:
        return jobs_queue(self.name)


class Cordon(models.Model):
    """A host marked unschedulable, as kubectl cordon does: no replica is placed
    on it; those it runs stay until they are drained (moved) or retired. A row
    of its own, not a column of GpuHost, whose row the host's own role may
    update: a host cannot lift its own cordon (hosts.grants gives it SELECT only)."""

    host = models.OneToOneField(GpuHost, on_delete=models.CASCADE, related_name="cordon")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    reason = models.CharField(max_length=255, blank=True)

    def __str__(self) -> str:
        return f"{self.host_id} cordoned"


class ChannelAuthority(models.Model):
    """Gantry's certificate authority for the channel to GPU hosts (one row): its
    certificate and revocation list, which hosts read. Its key is in
    ChannelSecrets, which hosts cannot read."""

    certificate = models.TextField(help_text="The authority's certificate (PEM).")
    revocation_list = models.TextField(help_text="The current revocation list (PEM), signed by the authority.")
    revocation_number = models.PositiveBigIntegerField(default=1, help_text="Grows with every new revocation list.")
    revocation_signed_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "deployments_channelauthority"

    def __str__(self) -> str:
        return f"channel authority (revocation list {self.revocation_number})"


class ChannelSecrets(models.Model):
    """The authority's private key and the web tier's (one row). Withheld from
    hosts' database roles (hosts.grants.WITHHELD_TABLES)."""

    authority_key = models.TextField()
    client_key = models.TextField(blank=True, help_text="The web tier's key; its certificate is a ChannelCertificate.")

    class Meta:
        db_table = "deployments_channelsecrets"

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
        db_table = "deployments_channelcertificate"
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
        db_table = "deployments_hostjointoken"
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
        db_table = "deployments_hostcredential"
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
        db_table = "deployments_gpu"
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


class OutboxMessage(models.Model):
    """A task for a host's worker, written in the same transaction as the change
    that asks for it (hosts.outbox). It is deleted once the broker has
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
        db_table = "deployments_outboxmessage"
        ordering = ["id"]
        indexes = [models.Index(fields=["queue", "id"])]

    def __str__(self) -> str:
        return f"{self.task}{tuple(self.args)} for {self.queue}"
