"""Model fields shared by Gantry's apps."""

from __future__ import annotations

import re
from typing import Any

import orjson
from django.db import models
from django.db.models import ExpressionWrapper, F


class JSONField(models.JSONField):
    """Django's JSONField, read with orjson: a 50-row builds page decodes 250
    values, and json.loads made that 0.28 ms of each request (orjson: 0.03 ms;
    docs/performance.md). Text with a run of 19 digits takes Django's own path
    (orjson reads an integer beyond 64 bits as an inexact float; JSON writes
    numbers in ASCII digits), as does what orjson refuses (nesting deeper than
    1024, text that is not JSON) and a field with a custom decoder."""

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        if isinstance(value, str) and self.decoder is None and not _LONG_NUMBER.search(value):
            try:
                return orjson.loads(value)
            except orjson.JSONDecodeError:
                pass
        return super().from_db_value(value, expression, connection)


_LONG_NUMBER = re.compile(r"[0-9]{19}")


class StoredJSON(JSONField):
    """A JSON column read as the text the database holds, in an orjson.Fragment:
    a list that only writes the value out has the API's renderer copy that text
    (core.api.renderers) instead of parsing it into Python and writing it back,
    0.6 ms of a 50-row builds page (docs/performance.md). PostgreSQL writes
    jsonb with a space after each colon and comma: the same JSON, other
    whitespace than the rest of the response. Only for values() rows that go
    straight to the renderer: nothing can read a Fragment in Python."""

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        return value if value is None else orjson.Fragment(value)


def stored_json(name: str) -> ExpressionWrapper:
    """Column ``name`` as StoredJSON, for values() (under a key of its own:
    values() takes no expression under a field's name)."""
    return ExpressionWrapper(F(name), output_field=StoredJSON())
