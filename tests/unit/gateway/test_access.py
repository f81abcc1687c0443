"""The gateway's key and route reads against the real database: its reader
threads keep their connections from one read to the next."""

from __future__ import annotations

import asyncio
import threading

import pytest
from django.db import connection
from django.db.backends.signals import connection_created

from gateway import access
from gateway.models import ApiKey

pytestmark = pytest.mark.django_db(transaction=True)


def _close_readers_connections() -> None:
    """Close the connection each reader thread holds (one call lands on each thread:
    they all wait at the barrier until every thread has one)."""
    threads = access.READER_THREADS
    barrier = threading.Barrier(threads)

    def close() -> None:
        barrier.wait(timeout=10)
        connection.close()

    for future in [access._READERS.submit(close) for _ in range(threads)]:
        future.result(timeout=20)


def test_a_hundred_reads_open_at_most_one_connection_per_reader_thread():
    opened = []

    def count(sender, connection, **kwargs):  # noqa: ANN001, ARG001
        opened.append(threading.current_thread().name)

    _close_readers_connections()
    connection_created.connect(count)
    try:

        async def reads() -> list[int]:
            return [await access.db(ApiKey.objects.count)() for _ in range(100)]

        counted = asyncio.run(reads())
    finally:
        connection_created.disconnect(count)
        _close_readers_connections()
    assert counted == [0] * 100
    assert 1 <= len(opened) <= access.READER_THREADS, opened
    assert all(name.startswith("gateway-read") for name in opened)


def test_a_reader_whose_connection_broke_opens_a_new_one():
    """A connection the database dropped (a restarted PostgreSQL) is replaced at the next read."""

    async def read() -> int:
        return await access.db(ApiKey.objects.count)()

    def break_connection() -> None:
        connection.ensure_connection()
        connection.connection.close()  # the server side of it gone, as after a restart
        connection.errors_occurred = True

    _close_readers_connections()
    try:
        for future in [access._READERS.submit(break_connection) for _ in range(access.READER_THREADS)]:
            future.result(timeout=20)
        assert asyncio.run(read()) == 0
    finally:
        _close_readers_connections()
