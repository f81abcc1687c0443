"""What keeps arriving: events (the audit timeline) and log lines, as cursor
lists, newest first. ``after=<id>`` asks only for what came after a row the
client already has: a browser that reconnects, or a follower of a running
build, reads the gap with it."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from rest_framework import serializers

from core.api.base import StrictSerializer
from core.api.lists import CursorPage, ListEndpoint
from core.events import EventPayload, payload_of_row
from core.models import Event
from core.permissions import ReadOrOperate
from deployments import selectors


class EventOut(serializers.Serializer):
    """One event, in the same shape the websockets deliver (core.events.event_payload)."""

    type = serializers.CharField()
    id = serializers.IntegerField()
    at = serializers.DateTimeField()
    kind = serializers.CharField(help_text="e.g. deployment.status, build.phase, alias.moved")
    source = serializers.CharField(help_text="user:<name>, worker:<host> or system")
    message = serializers.CharField()
    deployment = serializers.IntegerField(allow_null=True)
    build = serializers.IntegerField(allow_null=True)
    host = serializers.CharField(allow_null=True)
    from_status = serializers.CharField()
    to_status = serializers.CharField()
    data = serializers.DictField()

    def to_representation(self, instance: dict[str, Any]) -> EventPayload:
        # A list reads its events as values (selectors.event_rows).
        return payload_of_row(instance)


class AfterQuery(StrictSerializer):
    after = serializers.IntegerField(min_value=0, required=False, help_text="only rows with a greater id")


class EventQuery(AfterQuery):
    kind = serializers.CharField(max_length=64, required=False, help_text="exact, or a prefix ending in '.'")


class EventsQuery(EventQuery):
    deployment = serializers.IntegerField(min_value=1, required=False)
    build = serializers.IntegerField(min_value=1, required=False)
    model = serializers.IntegerField(min_value=1, required=False)
    host = serializers.CharField(max_length=63, required=False)
    actor = serializers.CharField(max_length=150, required=False, help_text="the username of who did it")
    since = serializers.DateTimeField(required=False)


class Events(ListEndpoint):
    """A cursor list of events; subclasses pick whose (get_queryset)."""

    permission_classes = [ReadOrOperate]
    serializer_class = EventOut
    pagination_class = CursorPage
    query_class = EventQuery
    ordering_fields = ("id",)
    ordering = "-id"

    def filter_rows(self, rows: QuerySet[Event], query: dict[str, Any]) -> QuerySet[Event]:
        return selectors.event_filter(rows, **query)


class EventList(Events):
    """GET /api/events/: the whole audit timeline, filtered by object, user, kind and time."""

    query_class = EventsQuery

    def get_queryset(self) -> QuerySet[Event]:
        return selectors.event_rows()


class LogLineOut(serializers.Serializer):
    id = serializers.IntegerField()
    line = serializers.CharField()


class LogLines(ListEndpoint):
    """A cursor list of log lines, newest first; subclasses pick whose."""

    permission_classes = [ReadOrOperate]
    serializer_class = LogLineOut
    pagination_class = CursorPage
    query_class = AfterQuery
    ordering_fields = ("id",)
    ordering = "-id"

    def filter_rows(self, rows: QuerySet, query: dict[str, Any]) -> QuerySet:
        return rows.filter(id__gt=query["after"]) if "after" in query else rows
