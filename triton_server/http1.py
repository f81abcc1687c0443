"""The web tier's HTTP/1.1 connections to Triton: a small pooled client for
one POST at a time per connection, its answer parsed by httptools (the parser
the web server itself runs on), for triton_server.client's generate_stream and
infer_async alone.

aiohttp's client did the same job with far more Python per request: on the
gateway's path it cost about 0.2 ms at the p50 and 2 ms at the p99 of every
answer before its first token (docs/performance.md). Here a request is one
write, and each piece of the answer is handed over as it is parsed.

Connections are kept per event loop and per server (and TLS channel), reused
while idle for less than IDLE_S. A request on a kept connection that the
server had closed meanwhile is sent again once on a new one: the server never
saw it. No answer for READ_TIMEOUT_S while one is awaited breaks the
connection.
"""

from __future__ import annotations

import asyncio
import ssl
import weakref
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httptools

IDLE_S = 30.0
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 60.0


class Unreachable(Exception):
    """No answer began: the connection could not be made, or broke before the answer's headers."""


class Broken(Exception):
    """The answer began and then broke off (the connection closed, failed or went silent)."""


@dataclass(frozen=True)
class Server:
    """Where a request goes: host:port, plain or over a TLS channel (asked for by name)."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None
    server_hostname: str | None = None

    @classmethod
    def at(cls, url: str, tls: ssl.SSLContext | None = None, server_hostname: str | None = None) -> Server:
        host, _, port = url.rpartition(":")
        return cls(host.strip("[]"), int(port), tls, server_hostname)


class Answer(asyncio.Protocol):
    """One connection, and the answer to the request in flight on it."""

    def __init__(self, server: Server, pool: _Pool) -> None:
        self.server, self.pool = server, pool
        self.read_timeout_s = READ_TIMEOUT_S
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        self.idle_since = 0.0
        self._waiter: asyncio.Future | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._begin()

    def _begin(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self._parts: deque[bytes] = deque()
        self._heard = self._headed = self._complete = self._reusable = False
        self._last_heard = self.loop.time()

    # --- what a caller uses -------------------------------------------------------------

    async def parts(self) -> AsyncIterator[bytes]:
        """The answer's body as it arrives (Broken if it breaks off)."""
        parts = self._parts
        while True:
            while parts:
                yield parts.popleft()
            if self._complete:
                return
            if self.lost is not None:
                raise Broken(_words(self.lost)) from self.lost
            await self._wait()

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([part async for part in self.parts()])

    def release(self) -> None:
        """Done with this answer: the connection goes back to the pool if the answer
        was read to its end and the server keeps it open, else it is closed."""
        self._stop_watchdog()
        if self._complete and self._reusable and self.lost is None:
            self.idle_since = self.loop.time()
            self.pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        """Drop the connection (a stream left early: the server sees it go and cancels)."""
        self._stop_watchdog()
        if self.transport is not None:
            self.transport.close()

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._heard, self._last_heard = True, self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._gone(ValueError(f"the server's answer is not HTTP: {exc}"))
            self.transport.abort()  # type: ignore[union-attr]
        self._wake()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._headed and not self._complete and not self._delimited():
            self._complete = True  # a body that ends with the connection
        self._gone(exc or ConnectionResetError("the server closed the connection"))
        self._stop_watchdog()
        self._wake()

    # --- httptools' callbacks -----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self._headed = True

    def on_body(self, body: bytes) -> None:
        self._parts.append(body)

    def on_message_complete(self) -> None:
        self._complete = True
        self._reusable = self.parser.should_keep_alive()  # (the parser forgets it once past the message)

    # --- within -------------------------------------------------------------------------

    def _delimited(self) -> bool:
        return "content-length" in self.headers or "chunked" in self.headers.get("transfer-encoding", "")

    def _gone(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc

    def _send(self, request: bytes, read_timeout_s: float) -> None:
        self._begin()
        self.read_timeout_s = read_timeout_s
        self.transport.write(request)  # type: ignore[union-attr]
        self._watchdog = self.loop.call_at(self._last_heard + self.read_timeout_s, self._check_silence)

    async def _headers(self) -> None:
        while not self._headed:
            if self.lost is not None:
                raise Unreachable(_words(self.lost)) from self.lost
            await self._wait()

    def _check_silence(self) -> None:
        due = self._last_heard + self.read_timeout_s
        if self.loop.time() < due:
            self._watchdog = self.loop.call_at(due, self._check_silence)
            return
        self._watchdog = None
        self._gone(TimeoutError(f"no answer for {self.read_timeout_s:g} s"))
        self.transport.abort()  # type: ignore[union-attr]

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    async def _wait(self) -> None:
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _words(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class _Pool:
    """Idle connections of one event loop, by server."""

    def __init__(self) -> None:
        self.idle: dict[Server, deque[Answer]] = {}
        self.swept_at = 0.0

    def take(self, server: Server) -> Answer | None:
        kept = self.idle.get(server)
        now = asyncio.get_running_loop().time()
        while kept:
            answer = kept.pop()
            if _usable(answer, now):
                return answer
            answer.close()
        return None

    def put(self, answer: Answer) -> None:
        self.idle.setdefault(answer.server, deque()).append(answer)
        if answer.idle_since - self.swept_at >= IDLE_S:
            self._sweep(answer.idle_since)

    def _sweep(self, now: float) -> None:
        """Close what idled past IDLE_S, for every server: a replica gone, or a channel's
        TLS context replaced (a revocation), is never asked for again."""
        self.swept_at = now
        for server, kept in list(self.idle.items()):
            for answer in [a for a in kept if not _usable(a, now)]:
                kept.remove(answer)
                answer.close()
            if not kept:
                del self.idle[server]


def _usable(answer: Answer, now: float) -> bool:
    return answer.lost is None and now - answer.idle_since < IDLE_S and not answer.transport.is_closing()  # type: ignore[union-attr]


_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Pool] = weakref.WeakKeyDictionary()


def _pool() -> _Pool:
    loop = asyncio.get_running_loop()
    pool = _pools.get(loop)
    if pool is None:
        pool = _pools[loop] = _Pool()
    return pool


async def _connect(server: Server, pool: _Pool) -> Answer:
    loop = asyncio.get_running_loop()
    extra: dict[str, Any] = {}
    if server.tls is not None:
        extra = {"ssl": server.tls, "server_hostname": server.server_hostname}
    try:
        _, answer = await asyncio.wait_for(
            loop.create_connection(lambda: Answer(server, pool), server.host, server.port, **extra),
            CONNECT_TIMEOUT_S,
        )
    except (OSError, asyncio.TimeoutError) as exc:  # (TLS failures are OSErrors)
        raise Unreachable(_words(exc) if not isinstance(exc, asyncio.TimeoutError) else "connect timed out") from exc
    return answer


async def post(
    server: Server, path: str, body: bytes, *, content_type: str = "application/json",
    read_timeout_s: float = READ_TIMEOUT_S,
) -> Answer:  # fmt: skip
    """POST ``body`` to ``path``; returns once the answer's headers are in (read its
    parts, then release or close it). Unreachable when no answer began."""
    pool = _pool()
    host = f"[{server.host}]" if ":" in server.host else server.host  # an IPv6 address, bracketed
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{server.port}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode("latin-1") + body
    while True:
        answer = pool.take(server)
        kept = answer is not None
        if answer is None:
            answer = await _connect(server, pool)
        answer._send(request, read_timeout_s)
        try:
            await answer._headers()
        except Unreachable:
            answer.close()
            if kept and not answer._heard:
                continue  # a kept connection the server had closed: it never saw the request
            raise
        except BaseException:
            answer.close()
            raise
        return answer
