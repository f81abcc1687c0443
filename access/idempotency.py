"""``Idempotency-Key`` on create actions: a client that retries a POST (its
connection dropped, its answer lost) sends the same key and gets the first
answer again instead of a second model, build, deployment, alias or key.

The key is a row per user, made before the view runs, so two copies racing
each other cannot both create: the second is told the first is still running
(409). Only a success is kept to be replayed; after a refusal or a failure the
key is free, and the retry runs again. A replayed answer carries
``Idempotent-Replayed: true``; secrets it held (a new token or key) are not
kept, so the replay has them as null. Keys are kept for a day.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
from collections.abc import Callable
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from access.models import IdempotentRequest
from common.problems import problem

HEADER = "Idempotency-Key"
KEPT_FOR = dt.timedelta(hours=24)
_PARAMETER = OpenApiParameter(
    HEADER,
    location=OpenApiParameter.HEADER,
    required=False,
    description="retry-safe create: the same key with the same body answers the first success again "
    "(for 24 hours); 1-255 printable ASCII characters",
)


def _refusal(code: int, kind: str, detail: str, errors: dict[str, list[str]] | None = None) -> Response:
    return Response(problem(code, kind, detail, errors), status=code)


def idempotent(*, redact: tuple[str, ...] = ()) -> Callable:
    """Make a view's ``post`` honour ``Idempotency-Key``; ``redact`` names answer
    fields that are secrets, never stored."""

    def wrap(post: Callable) -> Callable:
        @functools.wraps(post)
        def inner(view: Any, request: Request, *args: Any, **kwargs: Any) -> Response:
            key = request.headers.get(HEADER)
            if key is None:
                return post(view, request, *args, **kwargs)
            if not 1 <= len(key) <= 255 or not all(32 <= ord(c) < 127 for c in key):
                rule = "must be 1 to 255 printable ASCII characters"
                return _refusal(400, "invalid", f"{HEADER}: {rule}", {HEADER: [rule]})
            body = json.dumps(request.data, sort_keys=True, default=str).encode()
            digest = hashlib.sha256(request.path.encode() + b"\0" + body).hexdigest()
            row, earlier = _claim(request.user, key, request.method, request.path, digest)
            if earlier is not None:
                return _answer_again(earlier, request.path, digest)
            try:
                response = post(view, request, *args, **kwargs)
            except BaseException:
                row.delete()
                raise
            if 200 <= response.status_code < 300:
                kept = {k: (None if k in redact else v) for k, v in dict(response.data).items()}
                IdempotentRequest.objects.filter(pk=row.pk).update(status=response.status_code, response=kept)
            else:
                row.delete()
            return response

        return extend_schema(parameters=[_PARAMETER])(inner)

    return wrap


def _claim(user: Any, key: str, method: str, path: str, digest: str) -> tuple[Any, Any]:
    """Our new row for ``key``, or (None, the earlier request's row)."""
    cutoff = timezone.now() - KEPT_FOR
    for _ in range(2):
        try:
            with transaction.atomic():
                row = IdempotentRequest.objects.create(user=user, key=key, method=method, path=path, body_digest=digest)
            IdempotentRequest.objects.filter(user=user, created_at__lt=cutoff).delete()
            return row, None
        except IntegrityError:
            earlier = IdempotentRequest.objects.filter(user=user, key=key).first()
            if earlier is None or earlier.created_at >= cutoff:
                return None, earlier
            earlier.delete()  # an expired key: start afresh
    raise RuntimeError("unreachable")


def _answer_again(earlier: IdempotentRequest | None, path: str, digest: str) -> Response:
    if earlier is None:
        return _refusal(409, "conflict", f"a request with this {HEADER} just finished; send it again")
    if earlier.path != path or earlier.body_digest != digest:
        detail = f"this {HEADER} was used for a different request; use a new key for a new request"
        return _refusal(422, "idempotency_key_reused", detail, {HEADER: [detail]})
    if earlier.status is None:
        return _refusal(409, "conflict", f"the first request with this {HEADER} is still running; retry shortly")
    response = Response(earlier.response, status=earlier.status)
    response["Idempotent-Replayed"] = "true"
    return response
