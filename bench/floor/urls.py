"""The floor of bench/api.py: the same rows as /api/builds/ and /api/events/,
fetched and written as plainly as Django allows (one query, values(), no DRF,
no pagination object, no permission classes), on the same web server."""

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


urlpatterns = [path("floor/builds/", builds), path("floor/events/", events), *gantry]
