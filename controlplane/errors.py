"""What answers when no view does: a request for something that does not
exist, a database that cannot be reached (503, try again), or a bug. Under
/api/ that is JSON in the API's one error shape (a client parsing JSON never
meets an HTML page); elsewhere a page in Gantry's own layout."""

from __future__ import annotations

import sys

from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render

from common.problems import problem


def _is_api(request: HttpRequest) -> bool:
    return request.path.startswith("/api/")


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if _is_api(request):
        return JsonResponse(problem(404, "not_found", f"nothing at {request.path}"), status=404)
    return render(request, "404.html", {"path": request.path}, status=404)


def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Django's own refusals before any view: a malformed or oversized request."""
    if _is_api(request):
        return JsonResponse(problem(400, "invalid", "the request is malformed or too large"), status=400)
    return HttpResponse("<!doctype html><title>Bad request · Gantry</title><h1>Bad request</h1>", status=400)


def forbidden(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if _is_api(request):
        return JsonResponse(problem(403, "permission_denied", "this is not allowed"), status=403)
    return render(request, "403.html", status=403)


# How long a client should wait before trying again while the database is away.
RETRY_AFTER_S = 5


def server_error(request: HttpRequest) -> HttpResponse:
    # Django calls this while handling the exception: a database that cannot be
    # reached (restarting, say) is not a bug, and passes.
    if isinstance(sys.exc_info()[1], (OperationalError, InterfaceError)):
        return _unavailable(request)
    if _is_api(request):
        detail = "the server failed to answer this request; the error is in its log"
        return JsonResponse(problem(500, "server_error", detail), status=500)
    # No context processors, no database: the failure may be either.
    return HttpResponse(
        "<!doctype html><title>Server error · Gantry</title><h1>Something went wrong</h1>"
        "<p>The server could not answer this page. The error is in its log; try again in a moment.</p>",
        status=500,
    )


def _unavailable(request: HttpRequest) -> HttpResponse:
    detail = "the database cannot be reached right now; try again in a few seconds"
    if _is_api(request):
        response: HttpResponse = JsonResponse(problem(503, "database_unavailable", detail), status=503)
    else:
        response = HttpResponse(
            "<!doctype html><title>Unavailable · Gantry</title><h1>Gantry cannot reach its database</h1>"
            f"<p>{detail}.</p>",
            status=503,
        )
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response
