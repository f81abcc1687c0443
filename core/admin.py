"""The timeline in the admin, read-only; and the read-only base every app's
admin uses (the admin is for auditors: records are shown, never edited)."""

from __future__ import annotations

from django.contrib import admin

from core.models import Event


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False

    def has_delete_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = [
        "created_at", "source", "kind", "deployment", "build", "host", "from_status", "to_status", "message",
    ]  # fmt: skip
    list_filter = ["kind", "source"]
    search_fields = ["message"]
