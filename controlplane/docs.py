"""The parts of the manual that are generated from code, so they cannot drift:
the configuration table (from the variables controlplane/settings.py declares
through controlplane.env) and the API reference (from the OpenAPI schema).
``python manage.py gantry_docs`` writes them; ``--check`` fails when the
committed pages differ (make docs and the test suite run it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from django.conf import settings

from controlplane.env import DECLARED, Variable

CONFIGURATION = Path(settings.BASE_DIR) / "docs" / "configuration.md"
API_REFERENCE = Path(settings.BASE_DIR) / "docs" / "api-reference.md"
BEGIN = "<!-- generated from controlplane/settings.py by `manage.py gantry_docs`: edit the settings, not this -->"
END = "<!-- end of the generated table -->"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def settings_variables() -> list[Variable]:
    """The variables controlplane/settings.py declares, in its order (a test may
    declare others through the same helpers, in the same process)."""
    source = (Path(settings.BASE_DIR) / "controlplane" / "settings.py").read_text()
    read = set(re.findall(r'env_\w+\(\s*"([A-Z][A-Z0-9_]+)"', source))
    return [variable for name, variable in DECLARED.items() if name in read]


def configuration_table() -> str:
    """Every variable the settings read: its default, the values it takes, what it means."""
    rows = ["| variable | default | values | meaning |", "| --- | --- | --- | --- |"]
    for variable in settings_variables():
        rows.append(
            f"| `{variable.name}` | {_cell(variable.default)} | {_cell(variable.values)} | {_cell(variable.help)} |"
        )
    return "\n".join(rows)


def configuration_page(current: str) -> str:
    """``current`` with the text between the markers replaced by the table."""
    head, rest = current.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{configuration_table()}\n{END}{tail}"


def _type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    for combined in ("allOf", "oneOf", "anyOf"):
        if combined in schema:
            return " or ".join(_type(part) for part in schema[combined])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {_type(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema:
        extra = schema["additionalProperties"]
        return f"object of {_type(extra) if isinstance(extra, dict) else 'any'}"
    if "format" in schema:
        kind = f"{kind} ({schema['format']})"
    return kind + (" or null" if schema.get("nullable") else "")


def _rules(schema: dict[str, Any]) -> str:
    found = []
    if "enum" in schema:
        found.append("one of " + ", ".join(f"`{v}`" for v in schema["enum"] if v not in ("", None)))
    for key, words in (("minimum", ">="), ("maximum", "<="), ("minLength", "length >="), ("maxLength", "length <=")):
        if key in schema:
            found.append(f"{words} {schema[key]}")
    if "maxItems" in schema:
        found.append(f"at most {schema['maxItems']} items")
    if "default" in schema:
        found.append(f"default `{schema['default']}`")
    if schema.get("readOnly"):
        found.append("read-only")
    return "; ".join(found)


def _fields(schema: dict[str, Any]) -> list[str]:
    properties = schema.get("properties", {})
    if not properties:
        return [f"{_type(schema)}."]
    required = set(schema.get("required", []))
    rows = ["| field | type | required | rules | meaning |", "| --- | --- | --- | --- | --- |"]
    for name, field in properties.items():
        rows.append(
            f"| `{name}` | {_cell(_type(field))} | {'yes' if name in required else ''} | {_cell(_rules(field))} "
            f"| {_cell(field.get('description', ''))} |"
        )
    return rows


def _parameter(parameter: dict[str, Any]) -> str:
    where = f"{parameter['in']}, {_type(parameter.get('schema', {}))}"
    if parameter.get("required"):
        where += ", required"
    meaning = " ".join(parameter.get("description", "").split()).rstrip(".")
    return f"`{parameter['name']}` ({where})" + (f": {meaning}" if meaning else "")


def _body(content: dict[str, Any]) -> str:
    for media, value in content.items():
        schema = value.get("schema", {})
        return f"{_type(schema)} ({media})"
    return "none"


def api_reference() -> str:
    """The API reference page: every operation of the schema by tag, then every schema's fields."""
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    lines = [
        "# API reference",
        "",
        f"Generated from Gantry {schema['info']['version']}'s OpenAPI schema (`/api/schema/`) by "
        "`manage.py gantry_docs` with PostgreSQL settings: every operation under `/api/`, then every body's fields. "
        "The [REST API](api.md) page says how to authenticate, page and retry; every error has the "
        "[ErrorOut](#errorout) shape.",
    ]
    by_tag: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            if method in ("get", "post", "put", "patch", "delete"):
                by_tag.setdefault(operation.get("tags", ["other"])[0], []).append((method.upper(), path, operation))
    for tag in sorted(by_tag):
        lines += ["", f"## {tag}"]
        for method, path, operation in by_tag[tag]:
            lines += ["", f"### `{method} {path}`", ""]
            if operation.get("description"):
                lines += [" ".join(operation["description"].split()), ""]
            parameters = [p for p in operation.get("parameters", []) if p.get("in") in ("query", "path")]
            if parameters:
                lines += ["Parameters: " + "; ".join(_parameter(p) for p in parameters) + ".", ""]
            if "requestBody" in operation:
                lines += [f"Body: {_body(operation['requestBody'].get('content', {}))}.", ""]
            if not operation.get("security"):
                lines += ["No sign-in: the body carries its own credential.", ""]
            lines.append("| status | body | when |")
            lines.append("| --- | --- | --- |")
            for code, response in operation.get("responses", {}).items():
                body = _body(response.get("content", {}))
                lines.append(f"| {code} | {_cell(body)} | {_cell(response.get('description', ''))} |")
    lines += ["", "## Schemas"]
    for name, component in sorted(schema["components"]["schemas"].items()):
        lines += ["", f"### {name}", ""]
        if component.get("description"):
            lines += [" ".join(component["description"].split()), ""]
        lines += _fields(component)
    return "\n".join(lines) + "\n"


def generated() -> dict[Path, str]:
    """Each generated page and the text it must have."""
    return {CONFIGURATION: configuration_page(CONFIGURATION.read_text()), API_REFERENCE: api_reference()}
