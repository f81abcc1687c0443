"""POST /v1/chat/completions and /v1/completions: an llm alias's text, whole or
as server-sent events, in OpenAI's chat.completion and text_completion shapes."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from common.asgi_io import send_json, stream_events, unless_gone
from common.errors import GantryError
from deployments.models import ModelKind
from gateway import requests
from gateway.access import Caller, Target
from gateway.endpoints.shared import count, note, resolve
from gateway.errors import GatewayError, from_gantry
from gateway.metering import Admission, admit, prompt_bound
from gateway.requests import ChatRequest, CompletionRequest
from inference import tool_calls
from inference.generation import Outcome, Piece, Prepared, Sampling, generate, prepare_generation

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 1024  # chat has none in OpenAI's API (up to the context): this, within the context


async def chat(caller: Caller, body: Any, receive: Any, send: Any) -> None:
    await generation(caller, requests.parse(ChatRequest, body), receive, send, endpoint="/v1/chat/completions")


async def completions(caller: Caller, body: Any, receive: Any, send: Any) -> None:
    await generation(caller, requests.parse(CompletionRequest, body), receive, send, endpoint="/v1/completions")


class Shape(Protocol):
    """How an endpoint writes a generation: whole, or as its stream's events."""

    def whole(self, pieces: list[Piece], outcome: Outcome) -> dict[str, Any]: ...
    def opening(self) -> list[bytes]: ...
    def events(self, piece: Piece) -> list[bytes]: ...
    def closing(self, outcome: Outcome) -> list[bytes]: ...
    def failure(self, error: GatewayError) -> bytes: ...


async def generation(
    caller: Caller, data: ChatRequest | CompletionRequest, receive: Any, send: Any, *, endpoint: str,
    shape: Callable[[Target, Prepared], Shape] | None = None,
) -> None:  # fmt: skip
    """An llm alias's answer to a chat or completion request, whole or streamed,
    admitted and counted against the caller's key; written by ``shape`` (chat
    completion and text completion objects, unless another endpoint gives its own)."""
    chat = isinstance(data, ChatRequest)
    target = await resolve(caller, data.model, ModelKind.LLM, endpoint)
    context = target.route.context or 0
    default = CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETION_DEFAULT_MAX_TOKENS
    sampling = Sampling(
        max_tokens=data.limit or (min(default, context // 2) if context else default),
        temperature=data.temperature,
        top_p=data.top_p,
        seed=data.seed,
        stop=tuple(data.stop or ()),
        presence_penalty=data.presence_penalty,
        frequency_penalty=data.frequency_penalty,
        logit_bias=tuple(sorted((data.logit_bias or {}).items())),
        guide=_tool_grammar(data) if chat and data.calls_tools else data.guide,
        n=data.n,
        logprobs=data.logprobs_asked,
        names=_names(data, chat),
    )
    try:
        prepared = prepare_generation(
            prompt=None if chat else data.prompt[0],
            messages=[m.as_sent() for m in data.messages] if chat else None,
            sampling=sampling,
            route=target.route,
            tools=[t.model_dump(exclude_none=True) for t in data.tools] if chat and data.tools else None,
        )
    except GantryError as exc:
        raise from_gantry(exc, alias=target.alias) from exc
    # The most this request can take: its rendered prompt and every token it may write.
    admission = await admit(
        caller, target.alias, reserve=prompt_bound(prepared.inputs["text_input"]) + prepared.max_tokens
    )
    if shape is None:
        shaped: Shape = _Shape(chat=chat, alias=target.alias, notice=prepared.notice, n=data.n,
                               tools=chat and data.calls_tools, include_usage=data.include_usage)  # fmt: skip
    else:
        shaped = shape(target, prepared)
    outcome = Outcome()
    note(outcome=outcome)
    prompt_param = "messages" if chat else "prompt"
    if data.stream:
        # The first piece before the stream's headers: a refusal (a prompt beyond the
        # context, a model not ready) is an HTTP error, as OpenAI's, not an event.
        pieces = generate(prepared, stream=True, outcome=outcome)
        try:
            first = await anext(pieces, None)
        except GantryError as exc:
            count(caller, target.alias, admission, failed=True)
            raise from_gantry(exc, alias=target.alias, prompt_param=prompt_param) from exc
        events = _stream(caller, target, admission, _resumed(first, pieces), outcome, shaped)
        await stream_events(send, receive, events)
        return
    try:
        # A client that leaves before the whole answer stops the generation in Triton,
        # and what it used is counted and settled then, not when the model is done.
        answered, pieces = await unless_gone(receive, _joined(generate(prepared, stream=False, outcome=outcome)))
    except GantryError as exc:
        count(caller, target.alias, admission, completion=outcome.completion_tokens, failed=True)
        raise from_gantry(exc, alias=target.alias, prompt_param=prompt_param) from exc
    except BaseException:  # cancelled with the server, say: counted, its reservation returned
        count(caller, target.alias, admission, completion=outcome.completion_tokens, failed=True)
        raise
    count(caller, target.alias, admission, prompt=outcome.prompt_tokens or 0, completion=outcome.completion_tokens)
    if answered:
        await send_json(send, 200, shaped.whole(pieces, outcome))


def _names(data: ChatRequest | CompletionRequest, chat: bool) -> dict[str, str]:
    """The request's field for each extra a route may refuse (inference.generation.EXTRAS)."""
    return {
        "penalties": "presence_penalty" if data.presence_penalty else "frequency_penalty",
        "logit_bias": "logit_bias",
        "guide": "tools" if chat and data.calls_tools else "response_format",
        "n": "n",
        "logprobs": "logprobs",
        "top_logprobs": "top_logprobs" if chat else "logprobs",
    }


def _tool_grammar(data: ChatRequest) -> tuple[str, str]:
    """The grammar that holds the answer to the request's tools and tool_choice."""
    functions = [tool_calls.Function(t.function.name, t.function.parameters or {}) for t in data.tools or ()]
    return "lark", tool_calls.grammar(functions, choice=data.choice, parallel=data.parallel_tool_calls)


async def _joined(pieces: AsyncIterator[Piece]) -> list[Piece]:
    """A generation's pieces; closing it early (cancelled) ends Triton's request."""
    try:
        return [piece async for piece in pieces]
    finally:
        await pieces.aclose()  # type: ignore[attr-defined]


class _Shape:
    """OpenAI's chat.completion / text_completion objects and their stream chunks."""

    def __init__(
        self, *, chat: bool, alias: str, notice: str, n: int = 1, tools: bool = False, include_usage: bool = False
    ) -> None:
        self.chat, self.alias, self.notice, self.n, self.include_usage = chat, alias, notice, n, include_usage
        # With tools, each choice's text is read into content and tool calls (inference.tool_calls).
        self.tool_streams = [tool_calls.Stream() for _ in range(n)] if tools else None
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.offsets = [0] * n  # completions' text_offset: characters sent so far, per choice

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.alias, "choices": choices}
        if self.notice:
            body["notice"] = self.notice  # e.g. an untrained checkpoint: its text is noise
        return body

    def whole(self, pieces: list[Piece], outcome: Outcome) -> dict[str, Any]:
        texts: list[list[str]] = [[] for _ in range(self.n)]
        entries: list[list[dict[str, Any]] | None] = [None] * self.n
        for piece in pieces:
            texts[piece.index].append(piece.text)
            if piece.logprobs is not None:
                entries[piece.index] = (entries[piece.index] or []) + piece.logprobs
        choices = []
        for index in range(self.n):
            text = "".join(texts[index])
            reason = outcome.finish_reasons.get(index, outcome.finish_reason)
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self.tool_streams is not None:
                    message["content"], calls = tool_calls.read(text)
                    if calls:
                        message["tool_calls"], reason = [call.as_openai() for call in calls], "tool_calls"
                choice = {"index": index, "message": message}
            else:
                choice = {"index": index, "text": text}
            choice["logprobs"] = self._logprobs(index, entries[index])
            choice["finish_reason"] = reason
            choices.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        return {**body, "usage": _usage(outcome)}

    def _logprobs(self, index: int, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        """OpenAI's logprobs of a choice's tokens: chat's content entries, or the
        legacy completions' four lists."""
        if entries is None:
            return None
        if self.chat:
            return {"content": entries, "refusal": None}
        offsets = []
        for entry in entries:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(entry["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets,
        }

    def opening(self) -> list[bytes]:
        """Chat's first chunk of each choice: its role."""
        if not self.chat:
            return []
        return [self._sse(self.chunk(None, first=True, index=index)) for index in range(self.n)]

    def events(self, piece: Piece) -> list[bytes]:
        return [self._sse(chunk) for chunk in self.chunks(piece)]

    def closing(self, outcome: Outcome) -> list[bytes]:
        """Each choice's finish, the usage when asked, then [DONE]."""
        events = [self._sse(chunk) for chunk in self.last_chunks(outcome)]
        if self.include_usage:
            events.append(_sse({**self.usage_chunk(), "usage": _usage(outcome)}))
        return [*events, b"data: [DONE]\n\n"]

    def failure(self, error: GatewayError) -> bytes:
        return _sse(error.body())

    def _sse(self, chunk: dict[str, Any]) -> bytes:
        # With include_usage, OpenAI sends "usage": null on every chunk before the last.
        return _sse({**chunk, "usage": None} if self.include_usage else chunk)

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])

    def chunks(self, piece: Piece) -> list[dict[str, Any]]:
        """A piece's chunks: one, or with tools as many as the deltas it completes."""
        if self.tool_streams is None:
            return [self.chunk(piece.text, index=piece.index, logprobs=piece.logprobs)]
        deltas = self.tool_streams[piece.index].feed(piece.text)
        if not deltas:
            return [self.chunk(None, index=piece.index, logprobs=piece.logprobs)] if piece.logprobs else []
        return [
            self.chunk(None, index=piece.index, delta=delta.as_openai(), logprobs=piece.logprobs if i == 0 else None)
            for i, delta in enumerate(deltas)
        ]

    def last_chunks(self, outcome: Outcome) -> list[dict[str, Any]]:
        """What a choice's stream had held back, then its finish chunk, for each choice."""
        chunks = []
        for index in range(self.n):
            reason = outcome.finish_reasons.get(index, outcome.finish_reason)
            if self.tool_streams is not None:
                stream = self.tool_streams[index]
                chunks += [self.chunk(None, index=index, delta=d.as_openai()) for d in stream.finish()]
                reason = "tool_calls" if stream.calls else reason
            chunks.append(self.chunk(None if self.chat else "", reason, index=index))
        return chunks

    def chunk(
        self, text: str | None, finish_reason: str | None = None, *, first: bool = False, index: int = 0,
        logprobs: list[dict[str, Any]] | None = None, delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        if self.chat:
            if delta is None:
                delta = {"role": "assistant", "content": ""} if first else {}
                if text is not None and not first:
                    delta["content"] = text
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice["logprobs"] = self._logprobs(index, logprobs)
        choice["finish_reason"] = finish_reason
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])


def _usage(outcome: Outcome) -> dict[str, int]:
    prompt = outcome.prompt_tokens or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": prompt + outcome.completion_tokens,
    }


def _sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _resumed(first: Piece | None, rest: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
    """``first`` (already read), then the rest; closing this closes the rest (and Triton's request)."""
    try:
        if first is not None:
            yield first
        async for piece in rest:
            yield piece
    finally:
        await rest.aclose()


async def _stream(
    caller: Caller, target: Target, admission: Admission, pieces: AsyncIterator[Piece], outcome: Outcome, shape: Shape
) -> AsyncIterator[bytes]:
    failed = False
    try:
        for event in shape.opening():
            yield event
        async for piece in pieces:
            for event in shape.events(piece):
                yield event
        for event in shape.closing(outcome):
            yield event
    except GantryError as exc:
        failed = True
        yield shape.failure(from_gantry(exc, alias=target.alias))
    finally:  # also when the client went away: Triton's request ends, and what was generated counts
        await pieces.aclose()
        count(
            caller, target.alias, admission, prompt=outcome.prompt_tokens or 0, completion=outcome.completion_tokens,
            failed=failed,
        )  # fmt: skip
