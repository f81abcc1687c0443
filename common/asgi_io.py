"""Plain-ASGI answers for the inference doors that bypass Django (the lean
generate path, the OpenAI gateway): reading a body, answering JSON, and
streaming server-sent events that stop, and cancel the model's request, when
the client goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

MAX_BODY_BYTES = 16 * 1024 * 1024
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class BodyTooLarge(Exception):
    pass


@dataclass(frozen=True)
class Door:
    """An HTTP path answered before Django: which requests (``owns``, given the
    ASGI scope) and the ASGI app that answers them. ``paths`` is for people."""

    paths: str
    owns: Callable[[dict[str, Any]], bool]
    app: Any


class Doors:
    """ASGI: an HTTP request goes to the first door that owns it, everything
    else (other requests, websockets, lifespan) to ``rest``."""

    def __init__(self, doors: tuple[Door, ...], rest: Any) -> None:
        self.doors = doors
        self.rest = rest

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            for door in self.doors:
                if door.owns(scope):
                    await door.app(scope, receive, send)
                    return
        await self.rest(scope, receive, send)


async def read_body(receive: Any) -> bytes | None:
    """The request body, or None if the client went away first. BodyTooLarge past MAX_BODY_BYTES."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge(f"the body must be at most {MAX_BODY_BYTES // (1024 * 1024)} MiB")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def send_json(send: Any, status: int, body: Any, headers: list[tuple[bytes, bytes]] = ()) -> None:  # type: ignore[assignment]
    await send({"type": "http.response.start", "status": status, "headers": [*JSON_HEADERS, *headers]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


async def send_bytes(
    send: Any,
    status: int,
    body: bytes,
    content_type: str,
    *,
    headers: list[tuple[bytes, bytes]] = (),  # type: ignore[assignment]
) -> None:
    start = [(b"content-type", content_type.encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})


async def stream_events(send: Any, receive: Any, events: AsyncIterator[bytes | str]) -> None:
    """Send ``events`` as a server-sent event stream as they come. The headers
    wait for the first event and go with it, written back to back from this
    task (no hop to another before the first token), so that a client reads
    both at once. A client that goes away stops the stream; closing ``events``
    closes Triton's connection, and Triton cancels the request (the model stops
    generating)."""
    try:
        first = await anext(events, None)
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        if first is not None:
            await send(_event(first))

        async def pump() -> None:
            if first is not None:
                async for event in events:
                    await send(_event(event))
            await send({"type": "http.response.body", "body": b""})

        streaming, watching = asyncio.create_task(pump()), asyncio.create_task(disconnected(receive))
        await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
        for task in (streaming, watching):
            task.cancel()
        await asyncio.gather(streaming, watching, return_exceptions=True)
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def disconnected(receive: Any) -> None:
    """Returns once the client has gone away (its body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(receive: Any, work: Any) -> tuple[bool, Any]:
    """Await ``work`` (a coroutine) while watching the client: (True, its result),
    or (False, None) once the client went away first, ``work`` then cancelled
    (a generation's request closes, and Triton cancels it)."""
    working, watching = asyncio.ensure_future(work), asyncio.create_task(disconnected(receive))
    try:
        await asyncio.wait({working, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not working.done():
            working.cancel()
        await asyncio.gather(working, watching, return_exceptions=True)
    if working.cancelled():
        return False, None
    return True, working.result()


def _event(event: bytes | str) -> dict[str, Any]:
    body = event if isinstance(event, bytes) else event.encode()
    return {"type": "http.response.body", "body": body, "more_body": True}
