"""The web tier's pooled HTTP/1.1 connections to Triton (triton_server.http1),
against a real server on loopback that answers as the test says."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from triton_server import http1

Answerer = Callable[[int, bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


class _Server:
    """Reads each request (headers and Content-Length body) and lets ``answer(number on
    this connection, body, ...)`` write the answer; it returns False to close."""

    def __init__(self, answer: Answerer) -> None:
        self.answer, self.connections, self.requests, self.closed = answer, 0, 0, asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                body = await reader.readexactly(length)
                number += 1
                self.requests += 1
                if not await self.answer(number, body, reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()


async def _serve(answer: Answerer) -> tuple[_Server, asyncio.base_events.Server, http1.Server]:
    server = _Server(answer)
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    return server, listening, http1.Server.at(f"127.0.0.1:{port}")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _events(number: int, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Three server-sent events in chunks, the second split across two writes."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    writer.write(_chunk(b'data: {"n": 1}\n\n'))
    await writer.drain()
    writer.write(_chunk(b'data: {"n"'))
    await asyncio.sleep(0.01)
    writer.write(_chunk(b": 2}\n\n") + _chunk(b'data: {"n": 3}\n\n') + b"0\r\n\r\n")
    await writer.drain()
    return True


def test_an_answer_arrives_in_parts_and_its_connection_is_used_again() -> None:
    async def run() -> None:
        server, listening, target = await _serve(_events)
        async with listening:
            for _ in range(3):
                answer = await http1.post(target, "/v2/models/m/generate_stream", b"{}")
                assert answer.status == 200 and answer.headers["content-type"] == "text/event-stream"
                body = b"".join([part async for part in answer.parts()])
                answer.release()
                assert body == b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: {"n": 3}\n\n'
            assert server.requests == 3 and server.connections == 1

    asyncio.run(run())


def test_a_kept_connection_the_server_dropped_is_replaced_without_losing_the_request() -> None:
    async def answer(number: int, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if number == 2:  # the server gave up on the connection as the next request came
            return False
        payload = b"ok " + body
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
        await writer.drain()
        return True

    async def run() -> None:
        server, listening, target = await _serve(answer)
        async with listening:
            first = await http1.post(target, "/x", b"one")
            assert await first.read() == b"ok one"
            first.release()
            second = await http1.post(target, "/x", b"two")
            assert await second.read() == b"ok two"
            second.release()
            assert server.connections == 2

    asyncio.run(run())


def test_a_stream_left_early_closes_its_connection_so_the_server_can_cancel() -> None:
    async def endless(number: int, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while not reader.at_eof():
            writer.write(_chunk(b"data: {}\n\n"))
            await writer.drain()
            await asyncio.sleep(0.005)
            if await _closed(reader):
                break
        return False

    async def run() -> None:
        server, listening, target = await _serve(endless)
        async with listening:
            answer = await http1.post(target, "/x", b"{}")
            async for _ in answer.parts():
                break
            answer.close()
            await asyncio.wait_for(server.closed.wait(), 5)

    asyncio.run(run())


async def _closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 0.001) == b""
    except asyncio.TimeoutError:
        return False


def test_a_server_that_goes_silent_breaks_the_answer_after_the_read_timeout() -> None:
    async def silent_midway(
        number: int, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunk(b"data: {}\n\n"))
        await writer.drain()
        await asyncio.sleep(5)
        return False

    async def run() -> None:
        _, listening, target = await _serve(silent_midway)
        async with listening:
            answer = await http1.post(target, "/x", b"{}", read_timeout_s=0.2)
            parts = answer.parts()
            assert await anext(parts) == b"data: {}\n\n"
            with pytest.raises(http1.Broken, match="no answer for 0.2 s"):
                await anext(parts)
            answer.close()

    asyncio.run(run())


def test_a_server_silent_before_its_headers_is_unreachable() -> None:
    async def silent(number: int, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(5)
        return False

    async def run() -> None:
        _, listening, target = await _serve(silent)
        async with listening:
            with pytest.raises(http1.Unreachable, match="no answer for 0.2 s"):
                await http1.post(target, "/x", b"{}", read_timeout_s=0.2)

    asyncio.run(run())


def test_nothing_listening_is_unreachable() -> None:
    async def run() -> None:
        listening = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = listening.sockets[0].getsockname()[1]
        listening.close()
        await listening.wait_closed()
        with pytest.raises(http1.Unreachable, match="refused|Connect call failed"):
            await http1.post(http1.Server.at(f"127.0.0.1:{port}"), "/x", b"{}")

    asyncio.run(run())


def test_an_answer_ended_by_closing_the_connection_is_whole_and_not_kept() -> None:
    async def until_close(number: int, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n\r\nbusy, ")
        await writer.drain()
        writer.write(b"try later")
        return False

    async def run() -> None:
        server, listening, target = await _serve(until_close)
        async with listening:
            for _ in range(2):
                answer = await http1.post(target, "/x", b"{}")
                assert answer.status == 503 and await answer.read() == b"busy, try later"
                answer.release()
            assert server.connections == 2

    asyncio.run(run())


def test_an_answer_that_is_not_http_is_refused_by_name() -> None:
    async def garbage(number: int, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)
        return False

    async def run() -> None:
        _, listening, target = await _serve(garbage)
        async with listening:
            with pytest.raises(http1.Unreachable, match="not HTTP"):
                await http1.post(target, "/x", b"{}")

    asyncio.run(run())


def test_connections_idle_too_long_are_closed_for_every_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server no longer asked for (a replica gone, a channel's context replaced)
    does not keep its idle connections open."""
    monkeypatch.setattr(http1, "IDLE_S", 0.05)

    async def ok(number: int, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        return True

    async def run() -> None:
        gone, listening_gone, target_gone = await _serve(ok)
        _, listening, target = await _serve(ok)
        async with listening_gone, listening:
            for server in (target_gone, target):
                answer = await http1.post(server, "/x", b"{}")
                assert await answer.read() == b"ok"
                answer.release()
            assert not gone.closed.is_set()
            await asyncio.sleep(0.1)
            answer = await http1.post(target, "/x", b"{}")
            await answer.read()
            answer.release()
            await asyncio.wait_for(gone.closed.wait(), 5)

    asyncio.run(run())


def test_an_ipv6_server_is_reached_and_named_in_brackets() -> None:
    seen: list[bytes] = []

    async def run() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(await reader.readuntil(b"\r\n\r\n"))
            await reader.readexactly(2)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            writer.close()

        try:
            listening = await asyncio.start_server(handle, "::1", 0)
        except OSError:
            pytest.skip("this machine has no IPv6 loopback")
        port = listening.sockets[0].getsockname()[1]
        async with listening:
            answer = await http1.post(http1.Server.at(f"[::1]:{port}"), "/x", b"{}")
            assert answer.status == 200 and await answer.read() == b""
            answer.release()

    asyncio.run(run())
    assert b"\r\nHost: [::1]:" in seen[0]
