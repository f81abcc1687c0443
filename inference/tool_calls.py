"""Tool calls in the Hermes format, the one Gantry reads: what a checkpoint's
chat template shows the model (the functions' JSON in ``<tools>``) and what the
model answers, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` one
per call (Qwen2.5, Hermes 2 Pro and their fine-tunes; the template says so by
writing ``<tool_call>``).

Three things live here, for every door: the grammar that holds the model to
the request's tools while it decodes (a Lark grammar for llguidance: free text
then calls for ``auto``, calls only for ``required``, the one function named),
reading a whole answer into content and calls, and reading a streamed answer
into OpenAI's deltas as it comes (content, then each call's id and name, then
its arguments piece by piece).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The call's head as the grammar writes it (and as a model trained on the format does).
_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*', re.DOTALL)
# What may still close a call's arguments: the wrapper's brace and the start of the closing tag.
_TAIL = re.compile(r"\}\s*(?:<(?:/(?:t(?:o(?:o(?:l(?:_(?:c(?:a(?:l(?:l(?:>)?)?)?)?)?)?)?)?)?)?)?)?$")


def reads_tool_calls(template: str) -> bool:
    """Whether a chat template renders tools in the Hermes format."""
    return OPEN in template and "tools" in template


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]


def grammar(functions: list[Function], *, choice: str, parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect) of an answer for ``choice``: "auto"
    (text, or text then calls), "required" (calls only) or a function's name (one
    call of it). Each call's arguments follow its function's JSON schema; the tags
    are the tokenizer's own tokens (``<tool_call>``), as the template writes them."""
    named = [f for f in functions if f.name == choice]
    calls = [_call(f) for f in (named or functions)]
    lines = [f"call: {' | '.join(f'call_{i}' for i in range(len(calls)))}"]
    lines += [f"call_{i}: {call}" for i, call in enumerate(calls)]
    if named or not parallel:
        lines.append("calls: call")
    else:
        lines.append('calls: call ("\\n" call)*')
    start = "start: TEXT | TEXT? calls" if choice == "auto" else "start: calls"
    return "\n".join([start, *lines, "TEXT: /(?s:.+)/"]) + "\n"


def _call(function: Function) -> str:
    head = json.dumps(f'\n{{"name": {json.dumps(function.name)}, "arguments": ')
    schema = {**(function.parameters or {"type": "object"}), "x-guidance": {"whitespace_flexible": False}}
    return f'{OPEN} {head} %json {json.dumps(schema)} "}}\\n" {CLOSE}'


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Call:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def read(text: str) -> tuple[str | None, list[Call]]:
    """A whole answer as (content, calls): the text outside the calls (None when
    blank) and each call; an answer whose calls do not parse is all content."""
    calls, content, rest = [], [], text
    while OPEN in rest:
        before, _, after = rest.partition(OPEN)
        body, closed, rest = after.partition(CLOSE)
        parsed = _parse(body) if closed else None
        if parsed is None:
            return text, []
        content.append(before)
        calls.append(Call(new_call_id(), *parsed))
    content.append(rest)
    joined = "".join(content).strip()
    return (joined or None), calls


def _parse(body: str) -> tuple[str, str] | None:
    """A call's name and its arguments' JSON text as the model wrote it (what a
    stream sends piece by piece), if the call is a JSON object of both."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    head = _HEAD.match(body)
    if head is None or not isinstance(value, dict) or not isinstance(value.get("arguments"), dict):
        return None
    return value["name"], _arguments(body[head.end() :])


def _arguments(rest: str) -> str:
    """The arguments' text: what follows the head, less the call object's closing brace."""
    rest = rest.rstrip()
    return rest[:-1].rstrip() if rest.endswith("}") else rest


@dataclass
class Delta:
    """One piece of a streamed answer: content, or a call's start (index, id,
    name) or a piece of its arguments."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def as_openai(self) -> dict[str, Any]:
        if self.content is not None:
            return {"content": self.content}
        call: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            call.update(id=self.id, type="function", function={"name": self.name, "arguments": ""})
        else:
            call["function"] = {"arguments": self.arguments}
        return {"tool_calls": [call]}


@dataclass
class Stream:
    """Reads an answer's text as it streams into Deltas."""

    calls: list[Call] = field(default_factory=list)
    buffer: str = ""
    inside: bool = False
    sent: int = 0  # characters of the current call's arguments already sent

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        deltas: list[Delta] = []
        while True:
            if not self.inside:
                at = self.buffer.find(OPEN)
                if at == -1:
                    # Hold back what may be the start of a tag.
                    keep = next((n for n in range(len(OPEN) - 1, 0, -1) if self.buffer.endswith(OPEN[:n])), 0)
                    cut = len(self.buffer) - keep
                    if self._content(self.buffer[:cut]):
                        deltas.append(Delta(content=self.buffer[:cut]))
                    self.buffer = self.buffer[cut:]
                    return deltas
                if self._content(self.buffer[:at]):
                    deltas.append(Delta(content=self.buffer[:at]))
                self.buffer, self.inside, self.sent = self.buffer[at + len(OPEN) :], True, 0
                continue
            head = _HEAD.match(self.buffer)
            if head is None:
                return deltas
            if self.sent == 0 and (not self.calls or self.calls[-1].arguments is not None):
                name = json.loads(f'"{head.group(1)}"')
                self.calls.append(Call(new_call_id(), name, None))  # type: ignore[arg-type]
                deltas.append(Delta(index=len(self.calls) - 1, id=self.calls[-1].id, name=name))
            body = self.buffer[head.end() :]
            closed = body.find(CLOSE)
            if closed == -1:
                tail = _TAIL.search(body)
                ready = body[: tail.start()] if tail else body
            else:
                ready = _arguments(body[:closed])
            if len(ready) > self.sent:
                deltas.append(Delta(index=len(self.calls) - 1, arguments=ready[self.sent :]))
                self.sent = len(ready)
            if closed == -1:
                return deltas
            self.calls[-1].arguments = ready
            self.buffer, self.inside = body[closed + len(CLOSE) :], False

    def _content(self, text: str) -> bool:
        """Whether text outside the calls is content: the separators between and after calls are not."""
        return bool(text.strip()) or (bool(text) and not self.calls)

    def finish(self) -> list[Delta]:
        """What is left once the answer ends (text that only looked like a tag's start)."""
        rest, self.buffer = self.buffer, ""
        return [Delta(content=rest)] if self._content(rest) and not self.inside else []
