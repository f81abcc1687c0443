"""The /v1 request bodies, typed: pydantic models, as Triton's OpenAI frontend
declares them. JSON's own types (no string read as a number), a field nobody
defined refused by name, and a field of OpenAI's API that Gantry does not
implement accepted only at the value that changes nothing (``n: 1``,
``presence_penalty: 0``, ...) and otherwise refused by name. ``null`` is an
optional field left unset, as in OpenAI's API.

A refusal is a 400 in OpenAI's shape naming the first broken field (``param``,
``messages[0].content``) and its rule."""

from __future__ import annotations

import json
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
    "best_of": 1,
    "echo": False,
    "store": False,  # Gantry keeps no completions or responses
}
_NEVER = ("functions", "function_call", "suffix", "modalities", "audio", "prediction", "reasoning_effort",
          "web_search_options", "service_tier", "metadata")  # fmt: skip
UNSUPPORTED = "is not supported by Gantry's gateway"
MAX_N = 16  # sequences of one prompt (the transformers model's num_return_sequences)
MAX_LOGIT_BIAS = 300  # OpenAI's limit on a logit_bias map's entries


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


class CalledFunction(_Body):
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    """A call an assistant message made (sent back in the next turn)."""

    id: _name(64)
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Body):
    role: str
    content: Annotated[str, BeforeValidator(_content)] | None = None
    name: SpeakerName | None = None
    tool_calls: list[ToolCall] | None = Field(None, min_length=1)
    tool_call_id: _name(64) | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in chat_template.ROLES:
            raise ValueError(f"must be one of {', '.join(chat_template.ROLES)}")
        return role

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> Message:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls are an assistant message's")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        if self.content is None and self.tool_calls is None:
            raise ValueError("content is required (an assistant message may send tool_calls instead)")
        return self

    def as_sent(self) -> dict[str, Any]:
        """The message as the chat template renders it (a call's arguments as an
        object where they are JSON, as transformers' templates expect)."""
        sent = self.model_dump(exclude_none=True)
        sent["content"] = self.content or ""
        for call in sent.get("tool_calls", []):
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except ValueError:
                pass
        return sent


class FunctionDefinition(_Body):
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of its arguments (an object)
    strict: bool | None = None  # always enforced

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ValueError('must be a JSON schema of type "object"')
        return parameters


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class ToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (as JSON object keys) to a bias of -100 to 100."""
    if not isinstance(value, dict):
        raise ValueError("must be an object of token ids to biases")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"may hold at most {MAX_LOGIT_BIAS} token ids")
    bias = {}
    for key, number in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise ValueError(f"its keys must be token ids (non-negative integers), not {key!r}")
        if isinstance(number, bool) or not isinstance(number, int | float) or not -100 <= number <= 100:
            raise ValueError(f"its values must be numbers from -100 to 100 (token {key})")
        bias[int(key)] = float(number)
    return bias


Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


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
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: Annotated[dict[int, float], BeforeValidator(_logit_bias)] | None = None

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


class JsonSchema(_Body):
    """response_format's json_schema: the schema the answer must follow."""

    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    # The schema itself: JSON, checked by the grammar library (a refusal names it).
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self

    @property
    def guide(self) -> tuple[str, str] | None:
        """The grammar it asks for (guide type, text), if any."""
        if self.type == "json_object":
            return "json", ""
        if self.type == "json_schema":
            return "json_schema", json.dumps(self.json_schema.schema_)
        return None


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, min_length=1, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise FieldRule("max_tokens", "send max_tokens or max_completion_tokens, not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldRule("top_logprobs", "needs logprobs: true")
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise FieldRule("tools", "each function needs a name of its own")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise FieldRule("tool_choice", "needs tools")
        if isinstance(self.tool_choice, ToolChoice) and self.tool_choice.function.name not in names:
            raise FieldRule("tool_choice", f"names {self.tool_choice.function.name!r}, which is not among tools")
        if self.calls_tools and self.guide is not None:
            raise FieldRule("response_format", "cannot be held beside tool calls: send tool_choice none, or no tools")
        return self

    @property
    def choice(self) -> str:
        """none, auto (the default with tools), required, or the function named."""
        if isinstance(self.tool_choice, ToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (tools, and a choice other than none)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    @property
    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def guide(self) -> tuple[str, str] | None:
        return None if self.response_format is None else self.response_format.guide


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=5)  # the legacy API's: alternatives beside each token

    @property
    def logprobs_asked(self) -> int | None:
        return self.logprobs

    @property
    def guide(self) -> tuple[str, str] | None:
        return None


class EmbeddingRequest(_Body):
    model: ModelName
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=65536)  # Matryoshka embedders only
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
        elif value is not None:  # null: left unset
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
