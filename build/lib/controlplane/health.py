"""GET /healthz: whether this web process can answer and reach its database
(for load balancers, compose health checks and `make demo`). No sign-in, no
redirect to HTTPS, nothing about the system beyond ok or not."""

from __future__ import annotations

from django.db import connection
from django.http import HttpRequest, JsonResponse


def healthz(request: HttpRequest) -> JsonResponse:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception:  # noqa: BLE001 - any database failure is "not healthy"
        return JsonResponse({"status": "database unreachable"}, status=503)
    return JsonResponse({"status": "ok"})
