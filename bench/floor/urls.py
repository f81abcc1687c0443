"""The floors of bench/api.py: the same rows as /api/builds/ and /api/events/,
fetched and written as plainly as Django allows (one query, values(), no DRF,
no pagination object, no permission classes), on the same web server. The
short floors write five columns; the full ones every field the API's page
writes (the related names by join), so their ratio compares like with like."""

from django.http import HttpRequest, JsonResponse
from django.urls import path

from controlplane.urls import urlpatterns as gantry
from deployments.models import EngineBuild, Event


def builds(request: HttpRequest) -> JsonResponse:
    rows = EngineBuild.objects.order_by("-id").values("id", "status", "cache_key", "spec", "created_at")[:50]
    return JsonResponse({"results": list(rows)})


def events(request: HttpRequest) -> JsonResponse:
    rows = Event.objects.order_by("-id").values("id", "kind", "message", "data", "created_at")[:50]
    return JsonResponse({"results": list(rows)})


_NOT_LISTED = ("engine_config", "runtime_handle", "heartbeat_at", "model", "host", "created_by")
_BUILD_FIELDS = [f.attname for f in EngineBuild._meta.concrete_fields if f.name not in _NOT_LISTED]
_EVENT_FIELDS = ("id", "created_at", "kind", "source", "message", "deployment_id", "build_id", "host__name",
                 "from_status", "to_status", "data")  # fmt: skip


def builds_full(request: HttpRequest) -> JsonResponse:
    rows = EngineBuild.objects.order_by("-id").values(*_BUILD_FIELDS, "model__name", "host__name",
                                                      "created_by__username")[:50]  # fmt: skip
    return JsonResponse({"results": list(rows)})


def events_full(request: HttpRequest) -> JsonResponse:
    rows = Event.objects.order_by("-id").values(*_EVENT_FIELDS)[:50]
    return JsonResponse({"results": list(rows)})


urlpatterns = [
    path("floor/builds/", builds),
    path("floor/events/", events),
    path("floor/builds-full/", builds_full),
    path("floor/events-full/", events_full),
    *gantry,
]
