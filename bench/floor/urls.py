"""The floors of bench/api.py: the same rows as /api/builds/ and /api/events/,
fetched and written as plainly as Django allows (one query, values(), no DRF,
no pagination object, no permission classes), on the same web server. The
short floors write five columns; the full ones the very columns the API's page
reads (BuildOut.row_columns, events.EVENT_COLUMNS), so their ratio compares
like with like."""

from django.http import HttpRequest, JsonResponse
from django.urls import path

from controlplane.urls import urlpatterns as gantry
from core.events import EVENT_COLUMNS
from core.models import Event
from deployments.api.builds import BuildOut
from deployments.models import EngineBuild


def builds(request: HttpRequest) -> JsonResponse:
    rows = EngineBuild.objects.order_by("-id").values("id", "status", "cache_key", "spec", "created_at")[:50]
    return JsonResponse({"results": list(rows)})


def events(request: HttpRequest) -> JsonResponse:
    rows = Event.objects.order_by("-id").values("id", "kind", "message", "data", "created_at")[:50]
    return JsonResponse({"results": list(rows)})


def builds_full(request: HttpRequest) -> JsonResponse:
    rows = EngineBuild.objects.order_by("-id").values(*BuildOut.row_columns())[:50]
    return JsonResponse({"results": list(rows)})


def events_full(request: HttpRequest) -> JsonResponse:
    rows = Event.objects.order_by("-id").values(*EVENT_COLUMNS)[:50]
    return JsonResponse({"results": list(rows)})


urlpatterns = [
    path("floor/builds/", builds),
    path("floor/events/", events),
    path("floor/builds-full/", builds_full),
    path("floor/events-full/", events_full),
    *gantry,
]
