"""The REST API's body parser (its own module: DRF's settings import it while
the API modules are still loading)."""

from __future__ import annotations

from typing import Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError

from common import jsonbody


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser on the one body reader (common.jsonbody): a body that is
    not JSON or nests too deep is a 400 naming the rule, never a 500."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict | None = None) -> Any:
        try:
            return jsonbody.loads(stream.read() if stream is not None else b"")
        except jsonbody.InvalidJson as exc:
            raise ParseError(f"the body {exc}") from exc
