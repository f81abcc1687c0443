"""The OpenAI-compatible gateway: ``/v1/...`` answered on the ASGI server
itself (no Django request path), asynchronously end to end.

- GET  /v1/models, /v1/models/<alias>
- POST /v1/chat/completions, /v1/completions   (an llm alias; ``stream`` as server-sent events)
- POST /v1/embeddings                          (an embedding alias; float or base64)
- POST /v1/rerank                              (a reranker alias; query + documents -> results)

Every request carries ``Authorization: Bearer <gateway key>``; the key's scope
says which aliases it may name. Errors are OpenAI's shape (gateway.errors).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common import jsonbody, metrics
from common.asgi_io import BodyTooLarge, read_body, send_json, stream_events, unless_gone
from common.errors import GantryError
from deployments.models import ModelKind
from gateway import schemas
from gateway.access import DATABASE_AWAY, Caller, Target, authenticate, db, resolve, visible_aliases
from gateway.errors import GatewayError, database_away, from_gantry
from gateway.metering import Admission, admit, prompt_bound, settle, usage
from inference.embeddings import embed_async, rerank_async
from inference.generation import Outcome, Piece, Sampling, generate, prepare_generation

PREFIX = "/v1/"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 1024  # chat has none in OpenAI's API (up to the context): this, within the context


def owns(scope: dict[str, Any]) -> bool:
    """``/v1/...`` is the gateway's (controlplane.asgi's table)."""
    return scope["path"].startswith(PREFIX) or scope["path"] == "/v1"


@dataclass
class _Seen:
    """What /metrics says of one gateway request (common.metrics.observe_door)."""

    started: float = field(default_factory=time.monotonic)
    code: int = 0
    key: str = ""
    alias: str = ""
    model: str = ""
    outcome: Outcome | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def observe(self) -> None:
        outcome = self.outcome
        metrics.observe_door(
            door="gateway", alias=self.alias, key=self.key, model=self.model, code=self.code or 500,
            duration_s=time.monotonic() - self.started,
            first_token_s=None if outcome is None else outcome.first_token_after(self.started),
            inter_token_s=None if outcome is None else outcome.inter_token_s,
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
        )  # fmt: skip


_seen: ContextVar[_Seen] = ContextVar("gateway_seen")


async def handle(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if not metrics.enabled():
        await _handle(scope, receive, send)
        return
    seen = _Seen()
    _seen.set(seen)

    async def send_seen(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            seen.code = message["status"]
        await send(message)

    try:
        await _handle(scope, receive, send_seen)
    finally:
        seen.observe()


def _note(**labels: Any) -> None:
    """Name this request's key, alias, model or outcome for /metrics (while it is on)."""
    seen = _seen.get(None)
    if seen is not None:
        for name, value in labels.items():
            setattr(seen, name, value)


async def _handle(scope: dict[str, Any], receive: Any, send: Any) -> None:
    path, method = scope["path"], scope["method"]
    try:
        if path.startswith("/v1/models"):
            if method != "GET":
                raise GatewayError(405, f"{method} is not allowed on {path}; use GET", code="method_not_allowed")
            await _models(await _authenticate(scope["headers"]), path, send)
            return
        handler = _POST.get(path)
        if handler is None:
            raise GatewayError(404, f"Unknown endpoint {method} {path}.", code="unknown_url")
        if method != "POST":
            raise GatewayError(405, f"{method} is not allowed on {path}; use POST", code="method_not_allowed")
        caller = await _authenticate(scope["headers"])
        raw = await read_body(receive)
        if raw is None:
            return
        try:
            body = jsonbody.loads(raw)
        except jsonbody.InvalidJson as exc:
            raise GatewayError(400, f"the body {exc}", code="invalid_json") from exc
        await handler(caller, body, receive, send)
    except BodyTooLarge as exc:
        await send_json(send, 413, GatewayError(413, str(exc)).body())
    except GatewayError as exc:
        await send_json(send, exc.status, exc.body(), exc.headers())
    except DATABASE_AWAY:
        away = database_away()
        await send_json(send, away.status, away.body(), away.headers())


async def _authenticate(headers: list[tuple[bytes, bytes]]) -> Caller:
    caller = await authenticate(headers)
    _note(key=str(caller.key_id))
    return caller


async def _resolve(caller: Caller, name: str, kind: str, endpoint: str) -> Target:
    target = await resolve(caller, name, kind, endpoint)
    _note(alias=target.alias, model=target.triton_name)
    return target


# --- /v1/models ------------------------------------------------------------------------


async def _models(caller: Caller, path: str, send: Any) -> None:
    listed = await db(visible_aliases)(caller)
    if path in ("/v1/models", "/v1/models/"):
        await send_json(send, 200, {"object": "list", "data": listed})
        return
    name = path[len("/v1/models/") :]
    found = next((m for m in listed if m["id"] == name), None)
    if found is None:
        raise GatewayError(404, f"The model {name!r} does not exist or you do not have access to it.",
                           param="model", code="model_not_found")  # fmt: skip
    await send_json(send, 200, found)


# --- chat and completions --------------------------------------------------------------


async def _chat(caller: Caller, body: Any, receive: Any, send: Any) -> None:
    await _generation(caller, schemas.parse(schemas.ChatIn, body), receive, send, chat=True)


async def _completions(caller: Caller, body: Any, receive: Any, send: Any) -> None:
    await _generation(caller, schemas.parse(schemas.CompletionIn, body), receive, send, chat=False)


async def _generation(caller: Caller, data: dict[str, Any], receive: Any, send: Any, *, chat: bool) -> None:
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    target = await _resolve(caller, data["model"], ModelKind.LLM, endpoint)
    context = target.route.context or 0
    default = CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETION_DEFAULT_MAX_TOKENS
    sampling = Sampling(
        max_tokens=data.get("max_tokens") or (min(default, context // 2) if context else default),
        temperature=data.get("temperature"),
        top_p=data.get("top_p"),
        seed=data.get("seed"),
        stop=tuple(data.get("stop", ())),
    )
    try:
        prepared = prepare_generation(
            prompt=None if chat else data["prompt"][0],
            messages=[dict(m) for m in data["messages"]] if chat else None,
            sampling=sampling,
            route=target.route,
        )
    except GantryError as exc:
        raise from_gantry(exc, alias=target.alias) from exc
    # The most this request can take: its rendered prompt and every token it may write.
    admission = await admit(
        caller, target.alias, reserve=prompt_bound(prepared.inputs["text_input"]) + prepared.max_tokens
    )
    shape = _Shape(chat=chat, alias=target.alias, notice=prepared.notice)
    outcome = Outcome()
    _note(outcome=outcome)
    prompt_param = "messages" if chat else "prompt"
    if data["stream"]:
        # The first piece before the stream's headers: a refusal (a prompt beyond the
        # context, a model not ready) is an HTTP error, as OpenAI's, not an event.
        pieces = generate(prepared, stream=True, outcome=outcome)
        try:
            first = await anext(pieces, None)
        except GantryError as exc:
            _count(caller, target.alias, admission, failed=True)
            raise from_gantry(exc, alias=target.alias, prompt_param=prompt_param) from exc
        include_usage = data.get("stream_options", {}).get("include_usage", False)
        events = _stream(
            caller, target, admission, _resumed(first, pieces), outcome, shape, include_usage=include_usage
        )
        await stream_events(send, receive, events)
        return
    try:
        # A client that leaves before the whole answer stops the generation in Triton,
        # and what it used is counted and settled then, not when the model is done.
        answered, text = await unless_gone(receive, _joined(generate(prepared, stream=False, outcome=outcome)))
    except GantryError as exc:
        _count(caller, target.alias, admission, completion=outcome.completion_tokens, failed=True)
        raise from_gantry(exc, alias=target.alias, prompt_param=prompt_param) from exc
    except BaseException:  # cancelled with the server, say: counted, its reservation returned
        _count(caller, target.alias, admission, completion=outcome.completion_tokens, failed=True)
        raise
    _count(caller, target.alias, admission, prompt=outcome.prompt_tokens or 0, completion=outcome.completion_tokens)
    if answered:
        await send_json(send, 200, shape.whole(text, outcome))


async def _joined(pieces: AsyncIterator[Piece]) -> str:
    """A generation's whole text; closing it early (cancelled) ends Triton's request."""
    try:
        return "".join([piece.text async for piece in pieces])
    finally:
        await pieces.aclose()  # type: ignore[attr-defined]


class _Shape:
    """OpenAI's chat.completion / text_completion objects and their stream chunks."""

    def __init__(self, *, chat: bool, alias: str, notice: str) -> None:
        self.chat, self.alias, self.notice = chat, alias, notice
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.alias, "choices": choices}
        if self.notice:
            body["notice"] = self.notice  # e.g. an untrained checkpoint: its text is noise
        return body

    def whole(self, text: str, outcome: Outcome) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = outcome.finish_reason
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        return {**body, "usage": _usage(outcome)}

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])

    def chunk(self, text: str | None, finish_reason: str | None = None, *, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text is not None and not first:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
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
    caller: Caller,
    target: Target,
    admission: Admission,
    pieces: AsyncIterator[Piece],
    outcome: Outcome,
    shape: _Shape,
    *,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    failed = False
    try:
        if shape.chat:
            yield _sse(_with_usage(shape.chunk(None, first=True), include_usage))
        async for piece in pieces:
            yield _sse(_with_usage(shape.chunk(piece.text), include_usage))
        yield _sse(_with_usage(shape.chunk(None if shape.chat else "", outcome.finish_reason), include_usage))
        if include_usage:
            yield _sse({**shape.usage_chunk(), "usage": _usage(outcome)})
        yield b"data: [DONE]\n\n"
    except GantryError as exc:
        failed = True
        yield _sse(from_gantry(exc, alias=target.alias).body())
    finally:  # also when the client went away: Triton's request ends, and what was generated counts
        await pieces.aclose()
        _count(
            caller, target.alias, admission, prompt=outcome.prompt_tokens or 0, completion=outcome.completion_tokens,
            failed=failed,
        )  # fmt: skip


def _with_usage(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    # With include_usage, OpenAI sends "usage": null on every chunk before the last.
    return {**chunk, "usage": None} if include_usage else chunk


_settlements: set[asyncio.Task] = set()


def _count(
    caller: Caller, alias: str, admission: Admission, *, requests: int = 1, prompt: int = 0, completion: int = 0,
    failed: bool = False,
) -> None:  # fmt: skip
    """Count a request (finished, failed or abandoned) in the key's usage, and settle
    its token reservation to what it used."""
    _note(prompt_tokens=prompt, completion_tokens=completion)
    usage.count(caller.key_id, alias, requests=requests, prompt=prompt, completion=completion, failed=failed)
    if admission.window:
        task = asyncio.get_running_loop().create_task(settle(caller, admission, prompt + completion))
        _settlements.add(task)
        task.add_done_callback(_settlements.discard)


# --- embeddings and rerank -------------------------------------------------------------


async def _embeddings(caller: Caller, body: Any, receive: Any, send: Any) -> None:
    data = schemas.parse(schemas.EmbeddingIn, body)
    target = await _resolve(caller, data["model"], ModelKind.EMBEDDING, "/v1/embeddings")
    inputs = data["input"]
    # One request per input; each may take its bytes and the two tokens around it.
    admission = await admit(caller, target.alias, requests=len(inputs), reserve=prompt_bound(*inputs) + 2 * len(inputs))
    with _failures_counted(caller, target, admission, requests=len(inputs)):
        vectors, tokens = await embed_async(
            endpoints=target.endpoints,
            model=target.triton_name,
            texts=inputs,
            max_batch_size=target.max_batch_size,
        )
    _count(caller, target.alias, admission, requests=len(inputs), prompt=tokens)
    if data["encoding_format"] == "base64":
        encoded = [base64.b64encode(row.tobytes()).decode("ascii") for row in vectors]
    else:
        encoded = vectors.tolist()
    await send_json(
        send,
        200,
        {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)],
            "model": target.alias,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        },
    )


async def _rerank(caller: Caller, body: Any, receive: Any, send: Any) -> None:
    data = schemas.parse(schemas.RerankIn, body)
    target = await _resolve(caller, data["model"], ModelKind.RERANKER, "/v1/rerank")
    documents = data["documents"]
    # Each document is scored beside the query: both, and three tokens around them.
    reserve = (prompt_bound(data["query"]) + 3) * len(documents) + prompt_bound(*documents)
    admission = await admit(caller, target.alias, reserve=reserve)
    with _failures_counted(caller, target, admission):
        scores, tokens = await rerank_async(
            endpoints=target.endpoints, model=target.triton_name, query=data["query"], documents=documents
        )
    _count(caller, target.alias, admission, prompt=tokens)
    order = np.argsort(-scores, kind="stable")[: data.get("top_n") or len(documents)]
    results = []
    for index in order:
        result: dict[str, Any] = {"index": int(index), "relevance_score": float(scores[index])}
        if data["return_documents"]:
            result["document"] = {"text": documents[index]}
        results.append(result)
    await send_json(
        send,
        200,
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "object": "list",
            "model": target.alias,
            "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        },
    )


@contextmanager
def _failures_counted(caller: Caller, target: Target, admission: Admission, *, requests: int = 1) -> Iterator[None]:
    """A model's refusal or an unreachable server: counted as failed (its reservation
    returned), answered in OpenAI's shape."""
    try:
        yield
    except GantryError as exc:
        _count(caller, target.alias, admission, requests=requests, failed=True)
        raise from_gantry(exc, alias=target.alias) from exc


_POST = {
    "/v1/chat/completions": _chat,
    "/v1/completions": _completions,
    "/v1/embeddings": _embeddings,
    "/v1/rerank": _rerank,
}
