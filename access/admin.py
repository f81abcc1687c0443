"""Tokens in the admin: listed for auditors, revocable, never shown or made here
(a secret is made by the service and shown once to its user)."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from access import services
from access.models import ApiToken, ExternalIdentity, IdempotentRequest


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ["name", "prefix", "user", "state", "created_at", "expires_at", "last_used_at", "revoked_at"]
    list_filter = ["revoked_at"]
    search_fields = ["name", "prefix", "user__username"]
    readonly_fields = ["user", "name", "prefix", "created_at", "expires_at", "last_used_at", "revoked_at"]
    actions = ["revoke"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Revoke the selected tokens")
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> None:
        for token in queryset:
            services.token_revoke(token_id=token.pk, user=request.user)


@admin.register(IdempotentRequest)
class IdempotentRequestAdmin(admin.ModelAdmin):
    list_display = ["key", "user", "method", "path", "status", "created_at"]
    readonly_fields = ["user", "key", "method", "path", "body_digest", "status", "response", "created_at"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: IdempotentRequest | None = None) -> bool:
        return False


@admin.register(ExternalIdentity)
class ExternalIdentityAdmin(admin.ModelAdmin):
    """Who signs in through the OpenID provider, as which user (deactivate the user to keep them out)."""

    list_display = ["user", "issuer", "subject", "created_at"]
    search_fields = ["user__username", "subject"]
    readonly_fields = ["user", "issuer", "subject", "created_at"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: ExternalIdentity | None = None) -> bool:
        return False
