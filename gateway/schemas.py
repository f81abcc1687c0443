"""The /v1 request bodies, checked field by field. A field of OpenAI's API that
Gantry does not implement is accepted only at the value that changes nothing
(``n: 1``, ``presence_penalty: 0``, ...) and otherwise refused by name; a field
nobody defined is refused too, never silently ignored."""

from __future__ import annotations

import math
import re
import threading
from typing import Any

from rest_framework import serializers
from rest_framework.fields import empty

from core.api.base import StrictSerializer
from deployments import chat_template
from gateway.errors import GatewayError, bad_request
from inference.generation import MAX_PROMPT_CHARS

MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request
MAX_INPUT_CHARS = 32_000
MAX_DOCUMENTS = 1000

# Fields of OpenAI's API Gantry does not implement, and the one value each may take.
_NEUTRAL: dict[str, Any] = {
    "n": 1,
    "best_of": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logprobs": False,
    "echo": False,
    "parallel_tool_calls": True,
}
_NEVER = ("logit_bias", "top_logprobs", "tools", "tool_choice", "functions", "function_call", "suffix",
          "dimensions", "response_format", "modalities", "audio", "prediction", "reasoning_effort",
          "web_search_options", "service_tier", "store", "metadata")  # fmt: skip


class _OneOrMany(serializers.Field):
    """A string, or a list of strings (OpenAI's ``stop``, ``input`` and ``prompt``)."""

    def __init__(self, *, max_items: int, max_chars: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_items, self.max_chars = max_items, max_chars

    def to_internal_value(self, data: Any) -> list[str]:
        items = [data] if isinstance(data, str) else data
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise serializers.ValidationError("must be a string or a list of strings (token arrays are not supported)")
        if not 1 <= len(items) <= self.max_items:
            raise serializers.ValidationError(f"must hold 1 to {self.max_items} strings")
        if any(len(i) > self.max_chars for i in items):
            raise serializers.ValidationError(f"each string must be at most {self.max_chars} characters")
        return items

    def to_representation(self, value: Any) -> Any:
        return value


class _Content(serializers.Field):
    """A message's content: a string, or a list of text parts."""

    def to_internal_value(self, data: Any) -> str:
        if isinstance(data, str):
            text = data
        elif isinstance(data, list) and all(isinstance(p, dict) for p in data):
            kinds = {p.get("type") for p in data}
            if kinds - {"text"}:
                raise serializers.ValidationError(
                    f"only text parts are supported, not {sorted(map(str, kinds - {'text'}))}"
                )
            if not all(isinstance(p.get("text"), str) and set(p) <= {"type", "text"} for p in data):
                raise serializers.ValidationError('each part must be {"type": "text", "text": "..."}')
            text = "".join(p["text"] for p in data)
        else:
            raise serializers.ValidationError("must be a string or a list of text parts")
        if len(text) > MAX_PROMPT_CHARS:
            raise serializers.ValidationError(f"must be at most {MAX_PROMPT_CHARS} characters")
        return text

    def to_representation(self, value: Any) -> Any:
        return value


class _StreamOptions(StrictSerializer):
    include_usage = serializers.BooleanField(default=False)


class _Message(StrictSerializer):
    role = serializers.ChoiceField(choices=chat_template.ROLES)
    content = _Content()
    name = serializers.CharField(max_length=64, required=False)


class _Sampling(StrictSerializer):
    model = serializers.CharField(max_length=128)
    max_tokens = serializers.IntegerField(min_value=1, max_value=32768, required=False)
    temperature = serializers.FloatField(min_value=0.0, max_value=2.0, required=False)
    top_p = serializers.FloatField(min_value=0.0, max_value=1.0, required=False)
    seed = serializers.IntegerField(min_value=0, max_value=2**63 - 1, required=False)
    stop = _OneOrMany(max_items=4, max_chars=64, required=False)
    stream = serializers.BooleanField(default=False)
    stream_options = _StreamOptions(required=False)
    user = serializers.CharField(max_length=256, required=False)

    def validate_top_p(self, value: float) -> float:
        if value <= 0:
            raise serializers.ValidationError("must be greater than 0")
        return value

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if "stream_options" in data and not data["stream"]:
            raise serializers.ValidationError({"stream_options": "is only allowed with stream: true"})
        return data


class ChatIn(_Sampling):
    messages = _Message(many=True, allow_empty=False)
    max_completion_tokens = serializers.IntegerField(min_value=1, max_value=32768, required=False)

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        data = super().validate(data)
        if "max_tokens" in data and "max_completion_tokens" in data:
            raise serializers.ValidationError({"max_tokens": "send max_tokens or max_completion_tokens, not both"})
        if "max_completion_tokens" in data:
            data["max_tokens"] = data.pop("max_completion_tokens")
        return data


class CompletionIn(_Sampling):
    prompt = _OneOrMany(max_items=1, max_chars=MAX_PROMPT_CHARS)


class EmbeddingIn(StrictSerializer):
    model = serializers.CharField(max_length=128)
    input = _OneOrMany(max_items=MAX_INPUTS, max_chars=MAX_INPUT_CHARS)
    encoding_format = serializers.ChoiceField(choices=["float", "base64"], default="float")
    user = serializers.CharField(max_length=256, required=False)


class _Document(serializers.Field):
    def to_internal_value(self, data: Any) -> str:
        text = data.get("text") if isinstance(data, dict) and set(data) == {"text"} else data
        if not isinstance(text, str):
            raise serializers.ValidationError('must be a string or {"text": "..."}')
        if len(text) > MAX_INPUT_CHARS:
            raise serializers.ValidationError(f"must be at most {MAX_INPUT_CHARS} characters")
        return text

    def to_representation(self, value: Any) -> Any:
        return value


class RerankIn(StrictSerializer):
    model = serializers.CharField(max_length=128)
    query = serializers.CharField(max_length=MAX_INPUT_CHARS)
    documents = serializers.ListField(child=_Document(), min_length=1, max_length=MAX_DOCUMENTS)
    top_n = serializers.IntegerField(min_value=1, required=False)
    return_documents = serializers.BooleanField(default=False)
    user = serializers.CharField(max_length=256, required=False)


def parse(serializer_class: type[serializers.Serializer], body: Any) -> dict[str, Any]:
    """The checked fields of ``body``, or a 400 naming the first broken field and its rule."""
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object", code="invalid_body")
    for name in _NEVER:
        if body.get(name) not in (None, [], {}):
            raise bad_request(name, "is not supported by Gantry's gateway", code="unsupported_parameter")
    fields = {}
    for name, value in body.items():
        if name in _NEUTRAL and name not in serializer_class._declared_fields:
            if value is not None and value != _NEUTRAL[name]:
                raise bad_request(
                    name,
                    f"is not supported by Gantry's gateway (only {_NEUTRAL[name]!r})",
                    code="unsupported_parameter",
                )
        elif name not in _NEVER:
            fields[name] = value
    checker = _checker(serializer_class)
    try:
        return _plain_object(checker, fields)
    except _Unsure:
        pass  # DRF decides, and names the field and the rule
    try:
        return checker.run_validation(fields)
    except serializers.ValidationError as exc:
        param, rule = _first_error(exc.detail)
        code = "unsupported_parameter" if rule == "is not a known field" else None
        raise bad_request(param, "is not supported by Gantry's gateway" if code else rule, code=code) from None


_checkers = threading.local()


def _checker(serializer_class: type[serializers.Serializer]) -> serializers.Serializer:
    """One serializer of ``serializer_class`` per thread, its fields built once.

    A DRF serializer deep-copies its declared fields for every instance: three
    quarters of a body's check, and a fifth of the gateway's time before the first
    token (docs/performance.md). Checking keeps no state on the serializer or its
    fields, so one instance checks every body (within a thread, one at a time)."""
    made = _checkers.__dict__.setdefault("by_class", {})
    checker = made.get(serializer_class)
    if checker is None:
        checker = made[serializer_class] = serializer_class()
        checker.fields  # noqa: B018 - built now, once
    return checker


class _Unsure(Exception):
    """The quick check cannot vouch for a value: DRF checks the body instead."""


_SURROGATE = re.compile("[\ud800-\udfff]")


def _plain_object(serializer: serializers.Serializer, data: Any) -> dict[str, Any]:
    """What DRF's check of ``data`` returns, for a body of plain JSON values within
    the serializer's rules; _Unsure for anything else (an error, a value DRF would
    coerce), which DRF then checks.

    DRF's check of a chat body took a third of the gateway's time before its first
    token (docs/performance.md). This reads the same declared fields, their limits,
    the custom fields' own checks and the serializers' validate methods, so the
    rules stay in one place; a test holds it to DRF's results on generated bodies."""
    if type(data) is not dict:
        raise _Unsure
    fields = serializer.fields
    if not data.keys() <= fields.keys():
        raise _Unsure
    checked: dict[str, Any] = {}
    for name, field in fields.items():
        if name in data:
            value = _plain(field, data[name])
        elif field.required:
            raise _Unsure
        elif field.default is not empty:
            value = field.get_default()
        else:
            continue
        validate_field = getattr(serializer, f"validate_{name}", None)
        checked[name] = value if validate_field is None else _sure(validate_field, value)
    return _sure(serializer.validate, checked)


def _sure(check: Any, value: Any) -> Any:
    try:
        return check(value)
    except serializers.ValidationError:
        raise _Unsure from None


def _within(field: serializers.Field, value: Any) -> bool:
    low, high = getattr(field, "min_value", None), getattr(field, "max_value", None)
    return (low is None or value >= low) and (high is None or value <= high)


def _sized(field: serializers.Field, items: list) -> bool:
    low, high = getattr(field, "min_length", None), getattr(field, "max_length", None)
    return (low is None or len(items) >= low) and (high is None or len(items) <= high)


def _plain(field: serializers.Field, value: Any) -> Any:  # noqa: C901 - one case per kind of field
    kind = type(field)
    if value is None or field.read_only:
        raise _Unsure
    if kind is serializers.BooleanField:
        if type(value) is bool:
            return value
    elif kind is serializers.IntegerField:
        if type(value) is int and _within(field, value):
            return value
    elif kind is serializers.FloatField:
        if type(value) in (int, float) and math.isfinite(value) and _within(field, value):
            return float(value)
    elif kind is serializers.ChoiceField:
        if type(value) is str and value in field.choice_strings_to_values:
            return field.choice_strings_to_values[value]
    elif kind is serializers.CharField:
        if (
            type(value) is str and value and _sized(field, value) and "\x00" not in value
            and not (field.trim_whitespace and value != value.strip()) and not _SURROGATE.search(value)
        ):  # fmt: skip
            return value
    elif isinstance(field, serializers.ListSerializer) or kind is serializers.ListField:
        if type(value) is list and (value or field.allow_empty) and _sized(field, value):
            return [_plain(field.child, item) for item in value]
    elif isinstance(field, serializers.Serializer):
        return _plain_object(field, value)
    elif kind.__module__ == __name__ and not field.validators:  # this module's own fields: their one check
        return _sure(field.to_internal_value, value)
    raise _Unsure


def _first_error(errors: Any, path: str = "") -> tuple[str, str]:
    if isinstance(errors, dict):
        name, inner = next(iter(errors.items()))
        if name == "non_field_errors":
            return _first_error(inner, path)
        if isinstance(name, int):  # a nested list's errors come keyed by index
            return _first_error(inner, f"{path}[{name}]")
        return _first_error(inner, f"{path}.{name}" if path else str(name))
    if isinstance(errors, list):
        if all(isinstance(e, str) for e in errors):
            return path, " ".join(errors)
        index, inner = next((i, e) for i, e in enumerate(errors) if e)
        return _first_error(inner, f"{path}[{index}]")
    return path, str(errors)
