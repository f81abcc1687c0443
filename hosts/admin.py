"""Hosts in the admin, read-only: their GPUs, cordons, credentials,
certificates, join tokens, and the outbox of tasks for them."""

from __future__ import annotations

from django.contrib import admin

from core.admin import ReadOnlyAdmin
from hosts.models import ChannelCertificate, Cordon, Gpu, GpuHost, HostCredential, HostJoinToken, OutboxMessage


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0
    can_delete = False
    readonly_fields = [f.name for f in Gpu._meta.fields]

    def has_add_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False


@admin.register(GpuHost)
class GpuHostAdmin(ReadOnlyAdmin):
    list_display = ["name", "address", "channel_port", "channel_revoked", "last_heartbeat", "driver_version"]
    search_fields = ["name", "address"]
    inlines = [GpuInline]


@admin.register(Cordon)
class CordonAdmin(ReadOnlyAdmin):
    """Hosts on which no replica is placed (cordon, uncordon and drain through the API)."""

    list_display = ["host", "created_by", "created_at", "reason"]


@admin.register(HostCredential)
class HostCredentialAdmin(ReadOnlyAdmin):
    """Who may connect as which host (revoke through the API or `gantry`; passwords are not kept)."""

    list_display = ["host", "database_role", "redis_user", "created_at", "revoked_at"]
    list_filter = ["revoked_at"]
    exclude = ["redis_password_sha256"]


@admin.register(ChannelCertificate)
class ChannelCertificateAdmin(ReadOnlyAdmin):
    """What Gantry's channel authority signed (revoke a host through the API or `gantry`)."""

    list_display = ["serial", "host", "created_at", "not_after", "revoked_at"]
    list_filter = ["revoked_at"]
    search_fields = ["serial", "host__name"]


@admin.register(HostJoinToken)
class HostJoinTokenAdmin(ReadOnlyAdmin):
    list_display = ["host_name", "created_by", "created_at", "expires_at", "used_at", "used_by_host"]
    exclude = ["token_sha256"]


@admin.register(OutboxMessage)
class OutboxMessageAdmin(ReadOnlyAdmin):
    """Tasks waiting for the broker, and the parked ones it refused (dead letters)."""

    list_display = ["id", "task", "queue", "created_at", "attempts", "parked_at", "last_error"]
    list_filter = [("parked_at", admin.EmptyFieldListFilter), "queue", "task"]
