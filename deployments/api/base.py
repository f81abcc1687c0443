"""What every API module shares: the error mapping (one place for status
codes), the serializer that refuses unknown fields, and request helpers."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers, status
from rest_framework.exceptions import ValidationError as DRFValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from deployments.errors import (
    GantryError,
    InvalidTransition,
    NotFound,
    PermanentError,
    PermissionDenied,
    TransientError,
    ValidationFailed,
)

_STATUS_FOR = {
    ValidationFailed: status.HTTP_400_BAD_REQUEST,
    NotFound: status.HTTP_404_NOT_FOUND,
    PermissionDenied: status.HTTP_403_FORBIDDEN,
    InvalidTransition: status.HTTP_409_CONFLICT,
    # A model server that cannot be reached may be back soon; one that refused the request will refuse it again.
    TransientError: status.HTTP_503_SERVICE_UNAVAILABLE,
    PermanentError: status.HTTP_400_BAD_REQUEST,
}


def gantry_error(exc: GantryError) -> tuple[dict[str, Any], int]:
    """The body and status code of one of Gantry's errors: a ``detail`` line,
    and for bad input the broken rules by field."""
    code = next((code for error_type, code in _STATUS_FOR.items() if isinstance(exc, error_type)), 500)
    body: dict[str, Any] = {"detail": str(exc)}
    if isinstance(exc, ValidationFailed):
        body["errors"] = exc.errors
    return body, code


def error_body(detail: Any) -> dict[str, Any]:
    """The body of a serializer's refusal: one line, and the rules by field."""
    return {"detail": _flatten(detail), "errors": detail}


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Map Gantry's errors to status codes; keep a ``detail`` line on every error."""
    if isinstance(exc, GantryError):
        body, code = gantry_error(exc)
        return Response(body, status=code)
    response = drf_exception_handler(exc, context)
    if response is not None and isinstance(exc, DRFValidationError):
        response.data = error_body(exc.detail)
    return response


def _flatten(detail: Any, prefix: str = "") -> str:
    if isinstance(detail, dict):
        return "; ".join(_flatten(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}") for k, v in detail.items())
    if isinstance(detail, list):
        if all(not isinstance(item, (dict, list)) for item in detail):
            return f"{prefix}: {' '.join(str(item) for item in detail)}" if prefix else " ".join(map(str, detail))
        return "; ".join(_flatten(item, f"{prefix}[{i}]") for i, item in enumerate(detail) if item)
    return f"{prefix}: {detail}" if prefix else str(detail)


class _RefusesUnknownFields:
    """Refuses fields it does not know, so a typo is an error, not a silent default."""

    def to_internal_value(self, data: Any) -> Any:
        unknown = sorted(set(data) - set(self.fields)) if isinstance(data, dict) else []
        unknown_errors = {name: ["is not a known field"] for name in unknown}
        try:
            value = super().to_internal_value(data)
        except DRFValidationError as exc:
            errors = exc.detail if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail}
            raise DRFValidationError({**errors, **unknown_errors}) from exc
        if unknown_errors:
            raise DRFValidationError(unknown_errors)
        return value


class StrictSerializer(_RefusesUnknownFields, serializers.Serializer):
    pass


class StrictModelSerializer(_RefusesUnknownFields, serializers.ModelSerializer):
    pass


def int_param(request: Request, name: str, *, default: int, high: int) -> int:
    """An integer query parameter between 1 and ``high``, or a 400 naming it and the rule."""
    try:
        value = int(request.query_params.get(name, str(default)))
    except ValueError as exc:
        raise DRFValidationError({name: ["must be an integer"]}) from exc
    if not 1 <= value <= high:
        raise DRFValidationError({name: [f"must be between 1 and {high}"]})
    return value


def validated(serializer_class: type[serializers.Serializer], request: Request) -> dict[str, Any]:
    if not isinstance(request.data, dict):
        raise DRFValidationError({"body": ["must be a JSON object"]})
    serializer = serializer_class(data=request.data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


def require_empty_body(request: Request) -> None:
    """Actions take no body: anything sent is a mistake worth naming."""
    if request.data:
        raise DRFValidationError({"body": ["must be empty"]})
