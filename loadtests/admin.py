from django.contrib import admin

from loadtests.models import LoadPoint, LoadTest, TuningRun, TuningTrial


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


class TrialInline(admin.TabularInline):
    model = TuningTrial
    fields = ("number", "status", "params", "generation", "gpu_share", "goodput", "reason", "finished_at")
    readonly_fields = fields
    extra = 0
    can_delete = False


@admin.register(TuningRun)
class TuningRunAdmin(admin.ModelAdmin):
    """Read-only: tuning runs are started, cancelled and applied through the API and pages."""

    list_display = ("id", "deployment_name", "status", "start_generation", "applied_generation", "created_by",
                    "created_at", "finished_at")  # fmt: skip
    list_filter = ("status",)
    search_fields = ("deployment_name",)
    inlines = [TrialInline]

    def has_add_permission(self, request) -> bool:  # noqa: ANN001
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False
