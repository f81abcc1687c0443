"""The admin is for auditors: records are shown, the timeline is read-only."""

from __future__ import annotations

from django.contrib import admin

from core.admin import ReadOnlyAdmin
from core.models import Event
from deployments.models import Deployment, DeploymentModel, EngineBuild, RegisteredModel, Replica


@admin.register(RegisteredModel)
class RegisteredModelAdmin(ReadOnlyAdmin):
    list_display = ["name", "kind", "host", "inspection", "architecture", "size_bytes", "fingerprint", "created_by"]
    list_filter = ["kind", "inspection", "architecture", "host"]
    search_fields = ["name", "hub_id", "fingerprint"]


class BuildEventInline(admin.TabularInline):
    """The build's history: who requested it, each status and phase it reached, reuses."""

    model = Event
    fk_name = "build"
    extra = 0
    can_delete = False
    fields = ["created_at", "source", "actor", "kind", "from_status", "to_status", "message"]
    readonly_fields = fields
    ordering = ["created_at", "id"]

    def has_add_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False


class BuildPlacementInline(admin.TabularInline):
    """Where the engine is deployed."""

    model = DeploymentModel
    fk_name = "engine_build"
    extra = 0
    can_delete = False
    fields = ["deployment", "triton_name"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False


@admin.register(EngineBuild)
class EngineBuildAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "model",
        "host",
        "status",
        "phase",
        "trtllm_version",
        "compute_capability",
        "gpu_name",
        "builder_image",
        "created_by",
        "created_at",
        "finished_at",
    ]
    list_filter = ["status", "model", "compute_capability", "trtllm_version", "builder_image", "host"]
    search_fields = ["model__name", "cache_key", "image_digest"]
    inlines = [BuildEventInline, BuildPlacementInline]


class PlacementInline(admin.TabularInline):
    model = DeploymentModel
    extra = 0
    can_delete = False
    readonly_fields = [f.name for f in DeploymentModel._meta.fields]

    def has_add_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False


class ReplicaInline(admin.TabularInline):
    model = Replica
    extra = 0
    can_delete = False
    readonly_fields = [f.name for f in Replica._meta.fields]

    def has_add_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False


class EventInline(admin.TabularInline):
    model = Event
    fk_name = "deployment"
    extra = 0
    can_delete = False
    fields = ["created_at", "source", "kind", "from_status", "to_status", "message"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False


@admin.register(Deployment)
class DeploymentAdmin(ReadOnlyAdmin):
    list_display = ["name", "runtime", "status", "desired_state", "generation", "replicas", "created_by"]
    list_filter = ["status", "runtime", "replica_set__host"]
    search_fields = ["name"]
    exclude = ["admin_secret"]
    inlines = [PlacementInline, ReplicaInline, EventInline]
