"""How every collection under /api/ pages, filters and orders.

Two kinds of page, both sized by ``limit`` (default 50, at most 500):

- offset pages (``limit``, ``offset``, and a ``count``) for what people
  curate and that stays small: hosts, models, deployments, revisions, aliases,
  keys, tokens;
- cursor pages (``limit``, ``cursor``) where rows keep arriving: builds,
  events, log lines, metric samples. A page costs the same at the millionth row
  as at the first (no OFFSET, no COUNT) and never repeats or skips a row when
  new ones land while a client walks the pages.

Filters are a strict serializer of query parameters (``query_class``): an
unknown parameter or a bad value is a 400 that names it, never a silently
ignored filter that returns everything.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

from django.db.models import QuerySet
from rest_framework import serializers
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.fields import empty
from rest_framework.filters import OrderingFilter
from rest_framework.generics import GenericAPIView
from rest_framework.mixins import ListModelMixin
from rest_framework.pagination import CursorPagination, LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response

MAX_PAGE = 500
DEFAULT_PAGE = 50


MAX_OFFSET = 2**31 - 1


def _bounded(parameters: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The paging parameters as ListEndpoint.query checks them, for the schema."""
    bounds = {"limit": {"minimum": 1, "maximum": MAX_PAGE}, "offset": {"minimum": 0, "maximum": MAX_OFFSET}}
    for parameter in parameters:
        parameter["schema"].update(bounds.get(parameter["name"], {}))
    return parameters


class OffsetPage(LimitOffsetPagination):
    default_limit = DEFAULT_PAGE
    max_limit = MAX_PAGE

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        return _bounded(super().get_schema_operation_parameters(view))


class CursorPage(CursorPagination):
    page_size = DEFAULT_PAGE
    page_size_query_param = "limit"
    max_page_size = MAX_PAGE
    ordering = "-id"

    def decode_cursor(self, request: Request) -> Any:
        """DRF answers a cursor it cannot read with a 404, as if the list were
        gone: it is a bad parameter, a 400 that names it."""
        try:
            return super().decode_cursor(request)
        except NotFound as exc:
            raise ValidationError(
                {self.cursor_query_param: ["is not a cursor this list gave: follow next or previous"]}
            ) from exc

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        return _bounded(super().get_schema_operation_parameters(view))


class Ordering(OrderingFilter):
    """``?ordering=<field>`` or ``-<field>``, one of the view's ``ordering_fields``."""

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        return [
            {
                "name": self.ordering_param,
                "required": False,
                "in": "query",
                "description": f"the order of the rows (default {view.ordering})",
                "schema": {"type": "string", "enum": _orderings(view.ordering_fields)},
            }
        ]


def _orderings(fields: tuple[str, ...]) -> list[str]:
    return [f for field in fields for f in (field, f"-{field}")]


class NoFilters(serializers.Serializer):
    pass


class ListEndpoint(ListModelMixin, GenericAPIView):
    """GET a page of ``get_queryset()`` filtered by ``query_class`` through ``filter_rows``.

    ``ordering_fields`` are what ``?ordering=`` may name (each also with a
    leading ``-``); ``ordering`` is the default. A cursor list should order by
    something that only grows (the id), so that new rows land on one end.
    """

    pagination_class: ClassVar[type] = OffsetPage
    filter_backends: ClassVar[list[type]] = [Ordering]
    query_class: ClassVar[type[serializers.Serializer]] = NoFilters
    ordering_fields: ClassVar[tuple[str, ...]] = ("id",)
    ordering: ClassVar[str] = "id"

    def filter_rows(self, rows: QuerySet, query: dict[str, Any]) -> QuerySet:
        """Apply the validated filters; lists with filters override this."""
        return rows

    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        # Every row the filters match, for a subclass that sums them (usage totals).
        self.matching = self.filter_rows(self.get_queryset(), self.query())
        page = self.paginate_queryset(self.filter_queryset(self.matching))
        context = {**self.get_serializer_context(), **self.page_context(page)}
        return self.get_paginated_response(self.get_serializer(page, many=True, context=context).data)

    def page_context(self, page: list[Any]) -> dict[str, Any]:
        """What the serializer needs about the whole page, read in one go (a list
        may look up related rows for all its rows at once instead of row by row)."""
        return {}

    def query(self) -> dict[str, Any]:
        """The query parameters, checked: names, page size, ordering and filters."""
        params = self.request.query_params
        paging = {"cursor"} if issubclass(self.pagination_class, CursorPagination) else {"offset"}
        return checked_query(
            self.query_class,
            params,
            also=paging | {"limit", "ordering"},
            errors=_paging_errors(params, self.ordering_fields),
        )


def checked_query(
    query_class: type[serializers.Serializer],
    params: Any,
    *,
    also: set[str] | frozenset[str] = frozenset(),
    errors: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """Query parameters checked by ``query_class`` (``also`` names others the
    caller checks itself): an unknown name or a bad value is a 400 that names it."""
    fields, always = _query_fields(query_class)
    found: dict[str, list[str]] = {
        name: ["is not a known query parameter"] for name in sorted(set(params) - fields - set(also))
    }
    found.update(errors or {})
    given = {k: v for k, v in params.items() if k in fields}
    validated: dict[str, Any] = {}
    # A serializer instance deep-copies its fields: a plain page (no filter given,
    # none required or with a default) skips it, the most common request of a busy list.
    if given or always:
        checked = query_class(data=given)
        if not checked.is_valid():
            found.update(checked.errors)
        validated = dict(checked.validated_data) if not found else {}
    if found:
        raise ValidationError(found)
    return validated


@functools.cache
def _query_fields(query_class: type[serializers.Serializer]) -> tuple[frozenset[str], bool]:
    """A query serializer's parameter names, and whether it must run even with none
    given (a parameter is required or has a default, or it has rules of its own)."""
    declared = query_class._declared_fields  # noqa: SLF001 - the class's fields, not an instance's copies
    own_rules = query_class.validate is not serializers.Serializer.validate
    return frozenset(declared), own_rules or any(f.required or f.default is not empty for f in declared.values())


def _paging_errors(params: Any, ordering_fields: tuple[str, ...]) -> dict[str, list[str]]:
    errors: dict[str, list[str]] = {}
    for name, low in (("limit", 1), ("offset", 0)):
        if name in params:
            value = params[name]
            if not value.isdigit() or not low <= int(value) <= (MAX_PAGE if name == "limit" else MAX_OFFSET):
                rule = f"must be an integer from 1 to {MAX_PAGE}" if name == "limit" else "must be an integer >= 0"
                errors[name] = [rule]
    if "ordering" in params:
        allowed = _orderings(ordering_fields)
        if params["ordering"] not in allowed:
            errors["ordering"] = [f"must be one of: {', '.join(allowed)}"]
    return errors
