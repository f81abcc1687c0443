"""The gateway's records: aliases (the model names clients send), API keys
(stored hashed) and usage per key, alias and day."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models

from access.models import IssuedSecret
from core.validation import slug_validator
from deployments.models import Deployment

# What OpenAI-style clients send as "model": letters, digits and . _ - : / (e.g. "org/llama-3-8b:fp8").
alias_validator = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$",
    "1 to 128 characters: letters, digits and . _ - : /, starting with a letter or digit",
)


class Alias(models.Model):
    """A model name of the gateway, pointing at one model (placement name) of a
    deployment. Moving it to another deployment's model switches every client
    at once: each request resolves the alias once."""

    name = models.CharField(max_length=128, unique=True, validators=[alias_validator])
    deployment = models.ForeignKey(Deployment, on_delete=models.PROTECT, related_name="aliases")
    # The placement's Triton name, not the row: a new generation replaces placement rows, the name stays.
    triton_name = models.CharField(max_length=63, validators=[slug_validator])
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name_plural = "aliases"

    def __str__(self) -> str:
        return f"{self.name} -> {self.deployment_id}/{self.triton_name}"


class ApiKey(IssuedSecret):
    """A gateway key. The secret is shown once at creation; only its SHA-256 is
    kept (keys are 256 random bits, so a fast hash is enough)."""

    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, help_text="The key's first characters, to recognise it.")
    digest = models.CharField(max_length=64, unique=True, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="gateway_keys")
    all_aliases = models.BooleanField(default=False, help_text="May use every alias, present and future.")
    aliases = models.ManyToManyField(Alias, blank=True, related_name="keys")
    expires_at = models.DateTimeField(null=True, blank=True)
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Empty: no limit."
    )
    tokens_per_minute = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Prompt and completion tokens; empty: no limit.",
    )
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name = "API key"


class Usage(models.Model):
    """What one key asked of one alias on one day (UTC)."""

    key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="usage")
    alias = models.CharField(max_length=128, help_text="The alias as the client sent it (kept if it is deleted).")
    day = models.DateField()
    requests = models.PositiveBigIntegerField(
        default=0, help_text="Requests served (an embeddings call: one per input)."
    )
    failed = models.PositiveBigIntegerField(default=0, help_text="Requests answered with an error by the model.")
    refused = models.PositiveBigIntegerField(
        default=0, help_text="Requests refused by the key's rate limits (not counted in requests)."
    )
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["-day", "alias"]
        constraints = [models.UniqueConstraint(fields=["key", "alias", "day"], name="usage_unique_key_alias_day")]
        verbose_name_plural = "usage"

    def __str__(self) -> str:
        return f"{self.key_id} {self.alias} {self.day}: {self.requests} requests"
