from django.contrib import admin

from gateway.models import Alias, ApiKey, Usage


@admin.register(Alias)
class AliasAdmin(admin.ModelAdmin):
    list_display = ["name", "deployment", "triton_name", "updated_at"]
    search_fields = ["name"]
    # Moves go through the API or the gateway page, so they land on the timeline.
    readonly_fields = ["name", "deployment", "triton_name", "created_by", "created_at", "updated_at"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "prefix", "owner", "state", "expires_at", "last_used_at", "revoked_at"]
    list_filter = ["all_aliases"]
    search_fields = ["name", "prefix", "owner__username"]
    exclude = ["digest"]
    readonly_fields = ["prefix", "owner", "last_used_at", "created_at"]

    def has_add_permission(self, request) -> bool:  # noqa: ANN001 - a key's secret is made by the service
        return False


@admin.register(Usage)
class UsageAdmin(admin.ModelAdmin):
    list_display = ["day", "key", "alias", "requests", "failed", "prompt_tokens", "completion_tokens"]
    list_filter = ["day"]
    search_fields = ["alias", "key__name"]

    def has_change_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False

    def has_add_permission(self, request) -> bool:  # noqa: ANN001
        return False
