"""The /v1 request bodies, typed: pydantic models, as Triton's OpenAI frontend
declares them. JSON's own types (no string read as a number), a field nobody
defined refused by name, and a field of OpenAI's API that Gantry does not
implement accepted only at the value that changes nothing (``n: 1``,
``presence_penalty: 0``, ...) and otherwise refused by name. ``null`` is an
optional field left unset, as in OpenAI's API.

A refusal is a 400 in OpenAI's shape naming the first broken field (``param``,
``messages[0].content``) and its rule."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from gateway.errors import GatewayError, bad_request
from inference.generation import MAX_PROMPT_CHARS
from upstream import chat_template

MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request
MAX_INPUT_CHARS = 32_000
MAX_DOCUMENTS = 1000
MAX_TOKENS = 32768

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
UNSUPPORTED = "is not supported by Gantry's gateway"


class FieldRule(ValueError):
    """A rule broken by a field other than the one being checked (a body's
    check across fields): ``param`` names it."""

    def __init__(self, param: str, rule: str) -> None:
        super().__init__(rule)
        self.param, self.rule = param, rule


_SURROGATE = re.compile("[\ud800-\udfff]")


def _printable(text: str) -> str:
    if "\x00" in text:
        raise ValueError("may not hold null characters")
    if _SURROGATE.search(text):
        raise ValueError("may not hold surrogate characters")
    return text


def _name(max_length: int) -> Any:
    """A short name: trimmed, not blank, at most ``max_length`` characters."""
    return Annotated[
        str, StringConstraints(strip_whitespace=True, min_length=1, max_length=max_length), AfterValidator(_printable)
    ]


def _one_or_many(*, max_items: int, max_chars: int) -> Any:
    """A string, or a list of strings (OpenAI's ``stop``, ``input`` and ``prompt``)."""

    def strings(value: Any) -> list[str]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError("must be a string or a list of strings (token arrays are not supported)")
        if not 1 <= len(items) <= max_items:
            raise ValueError(f"must hold 1 to {max_items} strings")
        if any(len(i) > max_chars for i in items):
            raise ValueError(f"each string must be at most {max_chars} characters")
        return items

    return Annotated[list[str], BeforeValidator(strings)]


ModelName = _name(128)
UserName = _name(256)
SpeakerName = _name(64)
StopWords = _one_or_many(max_items=4, max_chars=64)
Prompt = _one_or_many(max_items=1, max_chars=MAX_PROMPT_CHARS)
Inputs = _one_or_many(max_items=MAX_INPUTS, max_chars=MAX_INPUT_CHARS)


def _content(value: Any) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, list) and all(isinstance(p, dict) for p in value):
        kinds = {p.get("type") for p in value} - {"text"}
        if kinds:
            raise ValueError(f"only text parts are supported, not {sorted(map(str, kinds))}")
        if not all(isinstance(p.get("text"), str) and set(p) <= {"type", "text"} for p in value):
            raise ValueError('each part must be {"type": "text", "text": "..."}')
        text = "".join(p["text"] for p in value)
    else:
        raise ValueError("must be a string or a list of text parts")
    if len(text) > MAX_PROMPT_CHARS:
        raise ValueError(f"must be at most {MAX_PROMPT_CHARS} characters")
    return text


def _document(value: Any) -> str:
    text = value.get("text") if isinstance(value, dict) and set(value) == {"text"} else value
    if not isinstance(text, str):
        raise ValueError('must be a string or {"text": "..."}')
    if len(text) > MAX_INPUT_CHARS:
        raise ValueError(f"must be at most {MAX_INPUT_CHARS} characters")
    return text


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamOptions(_Body):
    include_usage: bool = False


class Message(_Body):
    role: str
    content: Annotated[str, BeforeValidator(_content)]
    name: SpeakerName | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in chat_template.ROLES:
            raise ValueError(f"must be one of {', '.join(chat_template.ROLES)}")
        return role

    def as_sent(self) -> dict[str, str]:
        """The message as the chat template renders it."""
        return self.model_dump(exclude_none=True)


class _Sampling(_Body):
    model: ModelName
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: StopWords | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: UserName | None = None

    @model_validator(mode="after")
    def _options_need_a_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise FieldRule("stream_options", "is only allowed with stream: true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def limit(self) -> int | None:
        """The most tokens asked for, if any."""
        return self.max_tokens


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise FieldRule("max_tokens", "send max_tokens or max_completion_tokens, not both")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Prompt


class EmbeddingRequest(_Body):
    model: ModelName
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"
    user: UserName | None = None


class RerankRequest(_Body):
    model: ModelName
    query: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=MAX_INPUT_CHARS)]
    documents: list[Annotated[str, BeforeValidator(_document)]] = Field(min_length=1, max_length=MAX_DOCUMENTS)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = False
    user: UserName | None = None


Body = TypeVar("Body", bound="_Body")


def parse(model: type[Body], body: Any) -> Body:
    """``body`` checked as ``model``, or a 400 naming the first broken field and its rule."""
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object", code="invalid_body")
    fields = {}
    for name, value in body.items():
        if name in _NEVER:
            if value not in (None, [], {}):
                raise bad_request(name, UNSUPPORTED, code="unsupported_parameter")
        elif name in _NEUTRAL and name not in model.model_fields:
            if value is not None and value != _NEUTRAL[name]:
                raise bad_request(name, f"{UNSUPPORTED} (only {_NEUTRAL[name]!r})", code="unsupported_parameter")
        else:
            fields[name] = value
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        raise _refusal(exc.errors(include_url=False)[0]) from None


def _param(loc: tuple[str | int, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


# Pydantic's words for a rule, in the gateway's ("max_tokens must be ...").
_WORDS = (("Input should be", "must be"), ("String should have", "must have"), ("List should have", "must hold"))


def _refusal(error: dict[str, Any]) -> GatewayError:
    param, kind, context = _param(error["loc"]), error["type"], error.get("ctx", {})
    cause = context.get("error")
    if isinstance(cause, FieldRule):
        return bad_request(cause.param, cause.rule)
    if kind == "extra_forbidden":
        return bad_request(param, UNSUPPORTED, code="unsupported_parameter")
    if kind == "missing":
        rule = "is required"
    elif kind == "value_error":
        rule = str(cause) if cause is not None else error["msg"]
    elif kind == "too_short" and context.get("min_length") == 1:
        rule = "may not be empty"
    elif kind == "string_too_short":
        rule = "may not be blank"
    elif kind == "string_too_long":
        rule = f"must be at most {context['max_length']} characters"
    elif kind == "finite_number":
        rule = "must be a finite number"
    else:
        rule = error["msg"]
        for theirs, ours in _WORDS:
            rule = rule.replace(theirs, ours)
    return bad_request(param, rule)
