"""POST /v1/responses: OpenAI's Responses API over an llm alias, without stored
state (each request sends its whole input; ``store`` is false and there is no
``previous_response_id``).

Its body (ResponsesRequest, typed here with gateway.requests' parts, since it
is only ever turned into a chat completion: as_chat takes instructions,
messages, function calls and their outputs, function tools, tool_choice and
text.format) is generated as chat is; the answer is written as a
response object with output items (a message of output_text, function calls),
or streamed as the Responses API's typed events: response.created, then each
item's added, its text or arguments deltas and done events, then
response.completed.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, StringConstraints, model_validator

from gateway import requests
from gateway.access import Caller, Target
from gateway.endpoints.completions import generation
from gateway.errors import GatewayError, bad_request
from gateway.requests import (
    MAX_TOKENS,
    ChatRequest,
    FieldRule,
    FunctionDefinition,
    ModelName,
    UserName,
    _Body,
    _name,
    _printable,
    parse,
)
from inference import tool_calls
from inference.generation import MAX_PROMPT_CHARS, Outcome, Piece, Prepared


class _Item(_Body):
    """An input item as OpenAI's SDK sends it back: its id and status are ignored."""

    id: _name(128) | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class TextPart(_Body):
    type: Literal["input_text", "output_text"]
    text: Annotated[str, StringConstraints(max_length=MAX_PROMPT_CHARS), AfterValidator(_printable)]
    annotations: list[Any] | None = None


class InputMessage(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[str, StringConstraints(max_length=MAX_PROMPT_CHARS), AfterValidator(_printable)] | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: _name(64)
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    arguments: str


class FunctionCallOutput(_Item):
    type: Literal["function_call_output"]
    call_id: _name(64)
    output: Annotated[str, StringConstraints(max_length=MAX_PROMPT_CHARS), AfterValidator(_printable)]


def _input_item(value: Any) -> Any:
    """An input item by its type (a message may leave it out, as OpenAI's easy input does)."""
    if not isinstance(value, dict):
        raise ValueError("each input item must be an object")
    kinds = {"message": InputMessage, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutput}
    kind = kinds.get(value.get("type", "message"))
    if kind is None:
        raise ValueError(f"type must be one of {', '.join(kinds)} (other items are not supported)")
    return kind.model_validate(value)


def _as_items(value: Any) -> Any:
    """A string input is one user message."""
    if isinstance(value, str):
        if not value:
            raise ValueError("may not be empty")
        return [{"role": "user", "content": value}]
    return value


InputItem = Annotated[InputMessage | FunctionCallItem | FunctionCallOutput, BeforeValidator(_input_item)]


class ResponseTool(FunctionDefinition):
    """A function tool, flat as the Responses API writes it."""

    type: Literal["function"]


class NamedResponseTool(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if (self.type == "json_schema") != (self.schema_ is not None and self.name is not None):
            raise ValueError("name and schema are given with type json_schema, and only then")
        return self


class TextOptions(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    """POST /v1/responses, without stored state: no previous_response_id, store false."""

    model: ModelName
    input: Annotated[list[InputItem], BeforeValidator(_as_items)]
    instructions: Annotated[str, StringConstraints(max_length=MAX_PROMPT_CHARS)] | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool = False
    tools: list[ResponseTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedResponseTool | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    store: bool = False
    truncation: Literal["disabled"] | None = None
    user: UserName | None = None

    @model_validator(mode="after")
    def _nothing_stored(self) -> ResponsesRequest:
        if self.store:
            raise FieldRule("store", "Gantry keeps no responses: send store false (each request sends its input)")
        if not self.input:
            raise FieldRule("input", "may not be empty")
        return self

    def as_chat(self) -> ChatRequest:
        """The same request as a chat completion (ChatRequest's checks apply to it too)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        for item in self.input:
            if isinstance(item, InputMessage):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": item.text})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
                if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        chat: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream, "user": self.user,
            "parallel_tool_calls": self.parallel_tool_calls,
        }  # fmt: skip
        if self.tools:
            chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]  # fmt: skip
        if isinstance(self.tool_choice, NamedResponseTool):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type != "text":
            schema = {"name": fmt.name, "schema": fmt.schema_} if fmt.type == "json_schema" else None
            chat["response_format"] = {"type": fmt.type, **({"json_schema": schema} if schema else {})}
        return parse(ChatRequest, chat)


# The chat request's fields, as the Responses API names them (a refusal names the latter).
_FIELDS = {"response_format": "text.format", "messages": "input", "max_tokens": "max_output_tokens"}


async def responses(caller: Caller, body: Any, receive: Any, send: Any) -> None:
    data = requests.parse(ResponsesRequest, body)
    try:
        chat = data.as_chat()
    except GatewayError as exc:
        param = exc.param or ""
        head = param.split("[")[0].split(".")[0]
        if head not in _FIELDS:
            raise
        raise bad_request(_FIELDS[head] + param[len(head) :], exc.message) from exc

    def shape(target: Target, prepared: Prepared) -> _Response:
        return _Response(data, alias=target.alias, notice=prepared.notice, tools=chat.calls_tools)

    await generation(caller, chat, receive, send, endpoint="/v1/responses", shape=shape)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Response:
    """A response object, whole or as its stream of events."""

    def __init__(self, data: ResponsesRequest, *, alias: str, notice: str, tools: bool) -> None:
        self.data, self.alias, self.notice = data, alias, notice
        self.id, self.created = _id("resp"), int(time.time())
        self.stream = tool_calls.Stream() if tools else None
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the output so far
        self.open: dict[str, Any] | None = None  # the item being written (a message, or a function call)

    # --- the object ---

    def body(self, status: str, outcome: Outcome | None = None) -> dict[str, Any]:
        data = self.data
        fmt = data.text.format if data.text and data.text.format else None
        tool_choice = data.tool_choice
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.alias,
            "output": self.items, "error": None, "incomplete_details": None, "instructions": data.instructions,
            "max_output_tokens": data.max_output_tokens, "parallel_tool_calls": data.parallel_tool_calls,
            "temperature": data.temperature, "top_p": data.top_p, "store": False, "truncation": "disabled",
            "tool_choice": tool_choice.model_dump() if hasattr(tool_choice, "model_dump") else tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True, by_alias=True) for t in data.tools or ()],
            "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
            "metadata": {}, "user": data.user, "usage": None,
        }  # fmt: skip
        if outcome is not None:
            prompt = outcome.prompt_tokens or 0
            body["usage"] = {
                "input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": outcome.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + outcome.completion_tokens,
            }  # fmt: skip
            if outcome.finish_reason == "length":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.notice:
            body["notice"] = self.notice  # e.g. an untrained checkpoint: its text is noise
        return body

    def whole(self, pieces: list[Piece], outcome: Outcome) -> dict[str, Any]:
        text = "".join(piece.text for piece in pieces)
        content, calls = tool_calls.read(text) if self.stream is not None else (text, [])
        if content:
            self.items.append(self._message(content, "completed"))
        self.items += [self._call(call.id, call.name, call.arguments, "completed") for call in calls]
        return self.body(self._status(outcome), outcome)

    @staticmethod
    def _status(outcome: Outcome) -> str:
        return "incomplete" if outcome.finish_reason == "length" else "completed"

    @staticmethod
    def _message(text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if text or status == "completed" else []
        return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant", "content": content}

    @staticmethod
    def _call(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name, "arguments": arguments,
                "status": status}  # fmt: skip

    # --- the stream ---

    def _event(self, kind: str, **fields: Any) -> bytes:
        self.sequence += 1
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    def opening(self) -> list[bytes]:
        return [
            self._event("response.created", response=self.body("in_progress")),
            self._event("response.in_progress", response=self.body("in_progress")),
        ]

    def events(self, piece: Piece) -> list[bytes]:
        if self.stream is None:
            return self._text(piece.text) if piece.text else []
        events = []
        for delta in self.stream.feed(piece.text):
            events += self._delta(delta)
        return events

    def _delta(self, delta: tool_calls.Delta) -> list[bytes]:
        if delta.content is not None:
            return self._text(delta.content)
        if delta.id is not None:
            events = self._close()
            self.open = self._call(delta.id, delta.name or "", "", "in_progress")
            self.items.append(self.open)
            return [*events, self._event("response.output_item.added", output_index=len(self.items) - 1,
                                         item=dict(self.open))]  # fmt: skip
        self.open["arguments"] += delta.arguments or ""
        return [self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                            output_index=len(self.items) - 1, delta=delta.arguments)]  # fmt: skip

    def _text(self, text: str) -> list[bytes]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._close()
            self.open = self._message("", "in_progress")
            self.items.append(self.open)
            index = len(self.items) - 1
            events.append(self._event("response.output_item.added", output_index=index, item=dict(self.open)))
            self.open["content"] = [{"type": "output_text", "text": "", "annotations": []}]
            events.append(self._event("response.content_part.added", item_id=self.open["id"], output_index=index,
                                      content_index=0, part=dict(self.open["content"][0])))  # fmt: skip
        self.open["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, content_index=0, delta=text))  # fmt: skip
        return events

    def _close(self) -> list[bytes]:
        """The done events of the item being written, if any."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            events = [
                self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
            ]  # fmt: skip
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"])]  # fmt: skip
        return [*events, self._event("response.output_item.done", output_index=index, item=item)]

    def closing(self, outcome: Outcome) -> list[bytes]:
        events = []
        for delta in self.stream.finish() if self.stream is not None else ():
            events += self._delta(delta)
        events += self._close()
        status = self._status(outcome)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=self.body(status, outcome))]

    def failure(self, error: GatewayError) -> bytes:
        body = error.body()["error"]
        return self._event("error", code=body.get("code"), message=body["message"], param=body.get("param"))
