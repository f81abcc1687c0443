"""Who may call the API, and requests it must not repeat.

A personal token is stored as the SHA-256 digest of its secret: the secret
is shown once, when it is made, and a leaked database holds nothing that
authenticates. The prefix lets a person recognise a token in a list.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from core.fields import JSONField


class IssuedSecret(models.Model):
    """What a personal token and a gateway key share: a name, a prefix to
    recognise it by, an optional expiry and a revocation (their fields stay on
    each model, so neither table changes)."""

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def state(self) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= timezone.now():
            return "expired"
        return "active"


class ApiToken(IssuedSecret):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, help_text="What it is for, e.g. 'CI deploys'.")
    prefix = models.CharField(max_length=16, help_text="The token's first characters, to recognise it.")
    digest = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Empty: never expires.")
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name = "personal API token"


class IdempotentRequest(models.Model):
    """A create request sent with an ``Idempotency-Key`` header, and what it was
    answered: the same key and body again get the same answer, not a second object."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    key = models.CharField(max_length=255)
    method = models.CharField(max_length=8)
    path = models.CharField(max_length=512)
    body_digest = models.CharField(max_length=64)
    status = models.PositiveSmallIntegerField(null=True, help_text="Empty while the first request runs.")
    response = JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "key"], name="idempotency_key_per_user")]

    def __str__(self) -> str:
        return f"{self.method} {self.path} [{self.key}]"


class SignInFailures(models.Model):
    """Failed sign-ins for one username from one address, counted in the database
    (the source of truth): a Redis restart or outage neither wipes a running
    lockout nor turns it off."""

    key = models.CharField(max_length=255, unique=True)
    failures = models.PositiveIntegerField(default=0)
    expires_at = models.DateTimeField(
        help_text="when the count (and any lockout) ends: the first failure's time plus GANTRY_LOGIN_LOCKOUT_S"
    )

    def __str__(self) -> str:
        return f"{self.key}: {self.failures}"


class ExternalIdentity(models.Model):
    """A person an OpenID provider signs in (access.oidc): known by the provider's
    issuer and subject, never by a name or an e-mail the provider could reuse."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="external_identities")
    issuer = models.CharField(max_length=255)
    subject = models.CharField(max_length=255)
    created_at = models.DateTimeField(auto_now_add=True)
    refresh_token = models.TextField(
        blank=True,
        help_text="The provider's refresh token from the last sign-in or check: how Gantry asks the provider "
        "again whether this person still holds their roles (access.oidc.identity_recheck). A secret.",
    )
    checked_at = models.DateTimeField(
        null=True, blank=True, help_text="When the provider last vouched for this person's roles."
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["issuer", "subject"], name="one_user_per_external_identity")]
        verbose_name_plural = "external identities"

    def __str__(self) -> str:
        return f"{self.subject} at {self.issuer}"
