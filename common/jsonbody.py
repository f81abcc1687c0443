"""The one JSON reader for every request body Gantry takes (the REST API's parser,
the gateway, the lean generate door): bounded in size by the door and in
nesting here, so no body can reach a recursion limit in a parser, a validator
or the database's JSON encoder, and every refusal names its rule."""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

MAX_DEPTH = 32  # no body Gantry takes nests deeper than a few levels
# An integer of 19 digits or more may be beyond 64 bits, which orjson reads as a
# float: 10**30 became 1e+30, and a field's refusal said "not an integer"
# instead of naming its bound. Such a body is read again, exactly.
LONG_INTEGER = re.compile(rb"\d{19}")


class InvalidJson(ValueError):
    """The body is not JSON, or nests deeper than MAX_DEPTH."""


def loads(raw: bytes | str) -> Any:
    """``raw`` parsed (an empty body is None), or InvalidJson saying why."""
    if not raw:
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc):
            raise InvalidJson(f"must not nest deeper than {MAX_DEPTH} levels") from exc
        raise InvalidJson(f"must be JSON: {exc}") from exc
    _check_depth(value)
    if LONG_INTEGER.search(raw if isinstance(raw, bytes) else raw.encode()):
        value = json.loads(raw)  # the depth is checked: within Python's recursion
    return value


def _check_depth(value: Any) -> None:
    """InvalidJson when ``value`` holds containers deeper than MAX_DEPTH (no recursion)."""
    level = [value] if isinstance(value, dict | list) else []
    depth = 0
    while level:
        depth += 1
        if depth > MAX_DEPTH:
            raise InvalidJson(f"must not nest deeper than {MAX_DEPTH} levels")
        level = [
            child
            for container in level
            for child in (container.values() if isinstance(container, dict) else container)
            if isinstance(child, dict | list)
        ]
