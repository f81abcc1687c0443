from django.contrib import admin

from loadtests.models import LoadPoint, LoadTest


class PointInline(admin.TabularInline):
    model = LoadPoint
    fields = ("target", "level", "complete", "started_at", "finished_at")
    readonly_fields = fields
    extra = 0
    can_delete = False


@admin.register(LoadTest)
class LoadTestAdmin(admin.ModelAdmin):
    """Read-only: runs are started and cancelled through the API and pages."""

    list_display = ("id", "alias", "deployment_name", "status", "created_by", "created_at", "finished_at")
    list_filter = ("status", "kind")
    search_fields = ("alias", "deployment_name")
    inlines = [PointInline]

    def has_add_permission(self, request) -> bool:  # noqa: ANN001
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False
