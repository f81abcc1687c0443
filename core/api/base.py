"""What every API module shares: the error mapping (one place for status
codes), the serializer that refuses unknown fields, and request helpers."""

from __future__ import annotations

from typing import Any

from django.core.validators import MaxValueValidator, MinValueValidator
from rest_framework import serializers, status
from rest_framework.exceptions import ValidationError as DRFValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from common.errors import (
    ConfirmationRequired,
    GantryError,
    InvalidTransition,
    NotFound,
    PermanentError,
    PermissionDenied,
    TransientError,
    ValidationFailed,
)
from common.problems import problem
from core.validation import DB_INT_MAX

# Each of Gantry's errors: its status code and machine-readable code.
_STATUS_FOR: dict[type[GantryError], tuple[int, str]] = {
    ValidationFailed: (status.HTTP_400_BAD_REQUEST, "invalid"),
    NotFound: (status.HTTP_404_NOT_FOUND, "not_found"),
    PermissionDenied: (status.HTTP_403_FORBIDDEN, "permission_denied"),
    ConfirmationRequired: (status.HTTP_409_CONFLICT, "confirmation_required"),
    InvalidTransition: (status.HTTP_409_CONFLICT, "conflict"),
    # A model server that cannot be reached may be back soon; one that refused the request will refuse it again.
    TransientError: (status.HTTP_503_SERVICE_UNAVAILABLE, "unavailable"),
    PermanentError: (status.HTTP_400_BAD_REQUEST, "refused"),
}


def gantry_error(exc: GantryError) -> tuple[dict[str, Any], int]:
    """The body and status code of one of Gantry's errors."""
    code, kind = next(
        (found for error_type, found in _STATUS_FOR.items() if isinstance(exc, error_type)), (500, "error")
    )
    errors = exc.errors if isinstance(exc, ValidationFailed) else None
    return problem(code, kind, str(exc), errors), code


def error_body(detail: Any) -> dict[str, Any]:
    """The body of a serializer's refusal (a 400): one line, and the rules by field path."""
    errors = field_errors(detail)
    return problem(400, "invalid", "; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()), errors)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Every error a view raises, in the shape of ``problem``."""
    if isinstance(exc, GantryError):
        body, code = gantry_error(exc)
        return Response(body, status=code)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None  # a bug: Django's 500 handler answers (JSON under /api/, controlplane.urls)
    if isinstance(exc, DRFValidationError):
        response.data = error_body(exc.detail)
    else:
        detail = response.data.get("detail", "") if isinstance(response.data, dict) else response.data
        kind = getattr(detail, "code", None) or getattr(exc, "default_code", "error")
        response.data = problem(response.status_code, str(kind), str(detail))
    return response


def field_errors(detail: Any, prefix: str = "") -> dict[str, list[str]]:
    """DRF's nested error detail as one flat map from field path to messages,
    the notation the services use (``models[0].gpu_ids``); "body" for the whole body."""
    if isinstance(detail, dict):
        found: dict[str, list[str]] = {}
        for key, value in detail.items():
            if isinstance(key, int):  # a list field's item
                path = f"{prefix}[{key}]"
            elif key == "non_field_errors":  # the object as a whole
                path = prefix or "body"
            else:
                path = f"{prefix}.{key}" if prefix else str(key)
            found.update(field_errors(value, path))
        return found
    if isinstance(detail, list):
        if all(not isinstance(item, (dict, list)) for item in detail):
            return {prefix: [str(item) for item in detail]} if detail else {}
        found = {}
        for i, item in enumerate(detail):
            found.update(field_errors(item, f"{prefix}[{i}]"))
        return found
    return {prefix: [str(detail)]}


def _bounded(field: serializers.Field) -> None:
    """Hold a field to what the schema says of it: an integer (or a list's integer
    items) to what the database holds; a string's max_length to the string sent
    (DRF would check it after trimming whitespace, so 256 characters of which one is
    a leading NEL passed a limit of 255)."""
    if isinstance(field, serializers.ListField):
        _bounded(field.child)
    if isinstance(field, serializers.CharField) and field.max_length is not None:
        field.trim_whitespace = False
    if not isinstance(field, serializers.IntegerField):
        return
    if field.max_value is None:
        field.max_value = DB_INT_MAX
        message = field.error_messages["max_value"].format(max_value=DB_INT_MAX)
        field.validators.append(MaxValueValidator(DB_INT_MAX, message=message))
    if field.min_value is None:
        field.min_value = -DB_INT_MAX - 1
        message = field.error_messages["min_value"].format(min_value=-DB_INT_MAX - 1)
        field.validators.append(MinValueValidator(-DB_INT_MAX - 1, message=message))


class _RefusesUnknownFields:
    """Refuses fields it does not know, so a typo is an error, not a silent default;
    bounds every integer field to the database's 64 bits, and checks a string's
    length as sent (see _bounded)."""

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        for field in fields.values():
            _bounded(field)
        return fields

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


def validated(serializer_class: type[serializers.Serializer], request: Request) -> dict[str, Any]:
    """A JSON body checked by ``serializer_class``: its JSON types first (DRF would
    turn 12 into "12" or "1" into 1), then the serializer's rules."""
    body = request.data
    if not isinstance(body, dict):
        raise DRFValidationError({"body": ["must be a JSON object"]})
    serializer = serializer_class(data=body)
    errors = json_type_errors(serializer, body)
    if errors:
        raise DRFValidationError(errors)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


# The JSON type each kind of field takes; checked in this order (subclasses first).
_JSON_TYPES: list[tuple[type, tuple[type, ...], str]] = [
    (serializers.BooleanField, (bool,), "a boolean"),
    (serializers.IntegerField, (int,), "an integer"),
    (serializers.FloatField, (int, float), "a number"),
    (serializers.ChoiceField, (str,), "a string"),
    (serializers.CharField, (str,), "a string"),
    (serializers.DateTimeField, (str,), "a date-time string"),
    (serializers.DateField, (str,), "a date string"),
    (serializers.ListField, (list,), "a list"),
    (serializers.DictField, (dict,), "an object"),
]


def json_type_errors(field: Any, value: Any, path: str = "") -> dict[str, list[str]]:
    """Fields of ``value`` whose JSON type is not what ``field`` declares, by field path."""
    if value is None:
        return {}
    if isinstance(field, serializers.ListSerializer):
        if not isinstance(value, list):
            return {path: ["must be a list"]}
        return {
            k: v for i, item in enumerate(value) for k, v in json_type_errors(field.child, item, f"{path}[{i}]").items()
        }
    if isinstance(field, serializers.Serializer):
        if not isinstance(value, dict):
            return {path or "body": ["must be an object"]}
        found: dict[str, list[str]] = {}
        for name, child in field.fields.items():
            if name in value and not child.read_only:
                found.update(json_type_errors(child, value[name], f"{path}.{name}" if path else name))
        return found
    for kind, types, words in _JSON_TYPES:
        if isinstance(field, kind):
            if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
                return {path: [f"must be {words}"]}
            if isinstance(field, serializers.ListField) and field.child is not None:
                return {
                    k: v
                    for i, item in enumerate(value)
                    for k, v in json_type_errors(field.child, item, f"{path}[{i}]").items()
                }
            return {}
    return {}


def require_empty_body(request: Request) -> None:
    """Actions take no body: anything sent is a mistake worth naming."""
    if request.data:
        raise DRFValidationError({"body": ["must be empty"]})
