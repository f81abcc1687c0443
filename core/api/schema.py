"""The OpenAPI schema's view of Gantry's API (drf-spectacular): each list's
query parameters come from its ``query_class``, and every operation lists the
errors it can answer, in the one error shape (common.problems.problem)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.openapi import AutoSchema
from rest_framework import serializers

from core.api.base import StrictSerializer


class ErrorOut(serializers.Serializer):
    status = serializers.IntegerField()
    code = serializers.CharField(help_text="machine-readable: invalid, not_found, conflict, ...")
    detail = serializers.CharField()
    errors = serializers.DictField(
        child=serializers.ListField(child=serializers.CharField()),
        help_text="broken rules by field path (spec.dtype, models[0].gpu_ids[1]); empty unless the input was bad",
    )


# What any operation may answer besides its own success.
_COMMON = {
    "400": "bad input: the field paths and rules are in errors",
    "401": "no credentials, or an unknown, expired or revoked token",
    "403": "signed in without the role this needs",
    "429": "too many requests: wait Retry-After seconds",
}
_BY_METHOD = {
    "POST": {
        "404": "no such object",
        "409": "its state does not allow it now",
        "503": "a host or server is unreachable",
    },
    "PUT": {"404": "no such object", "409": "its state does not allow it now"},
    "PATCH": {"404": "no such object", "409": "its state does not allow it now"},
    "DELETE": {"404": "no such object", "409": "refused while it is running or in use"},
    "GET": {"404": "no such object"},
}


class GantrySchema(AutoSchema):
    def get_override_parameters(self) -> list[Any]:
        parameters = super().get_override_parameters()
        query_class = getattr(self.view, "query_class", None)
        if self.method == "GET" and query_class is not None and query_class().fields:
            parameters = [query_class, *parameters]
        return parameters

    def _get_response_bodies(self, direction: str = "response") -> dict[str, Any]:
        bodies = super()._get_response_bodies(direction)
        for code, description in {**_COMMON, **_BY_METHOD.get(self.method, {})}.items():
            if code not in bodies:
                bodies[code] = self._get_response_for_code(ErrorOut, code, direction=direction)
                bodies[code]["description"] = description
        return bodies


def refuse_unknown_fields(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """Request bodies refuse fields they do not know (StrictSerializer): say so
    in the schema (``additionalProperties: false``), so a client generated from
    it, or a fuzzer, knows an extra field is an error and not ignored."""
    inherited = " ".join((StrictSerializer.__mro__[1].__doc__ or "").split())
    for name, component in result.get("components", {}).get("schemas", {}).items():
        if name.endswith("Request") and component.get("type") == "object":
            component["additionalProperties"] = False
        if " ".join(component.get("description", "").split()) == inherited:
            del component["description"]  # the base class's words on itself, not the body's meaning
    return result
