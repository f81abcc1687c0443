"""Routing a request for a deployment's model across its replicas that answer.

Every door (the gateway, the REST generate action, the browser's chat and
playground) reads a deployment's answering replicas as ``Endpoint``s, kept a
second per process (so every process sees a change within a second), and
hands them here.

Each process keeps, per replica, its requests in flight and its failures in a
row. ``pick`` takes the replica with the fewest requests in flight; the
replicas' queue time (their last scrape) breaks ties, then a turn that rotates.
A replica that failed GANTRY_EJECT_AFTER_FAILURES requests in a row is left
out for GANTRY_EJECT_COOLOFF_S, then tried again by itself; both are said on
its timeline. ``call`` runs a request on one replica and, when it fails before
it gave anything (a TransientError: unreachable, or a 5xx), once more on
another.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils import timezone

from common import pki
from common.errors import TransientError
from deployments.models import Replica
from deployments.services.replicas import record_replica_event
from deployments.states import ANSWERING
from hosts.services.channel import client_context
from triton_server.client import Channel

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Endpoint:
    """One answering replica of a deployment, as a request reaches it."""

    replica_id: int
    url: str  # host:port: its Triton's HTTP endpoint on loopback, or its host's channel
    label: str  # "r2 on gpu-02", for words
    queue_ms: float = 0.0
    stale: bool = False  # its host stopped beating: tried only when no other replica is left
    channel: Channel | None = None  # a replica on another host: through that host's channel


def answering(deployment_id: int) -> list[Endpoint]:
    """The deployment's replicas that answer requests now (ready or degraded), in
    one query. Those on a host that stopped beating are marked stale: its server
    may be gone with it, or may serve on without its worker.

    A host on loopback is this machine: its servers are reached there. Any
    other is reached through its channel (mutual TLS); one without a channel
    yet, or whose certificates are revoked, is not reached at all."""
    beaten = timezone.now() - timedelta(
        seconds=settings.GANTRY_HEARTBEAT_INTERVAL * settings.GANTRY_HOST_OFFLINE_AFTER_BEATS
    )
    rows = (
        Replica.objects.filter(deployment_id=deployment_id, status__in=ANSWERING, host__channel_revoked=False)
        .order_by("serial")
        .values_list(
            "pk", "serial", "host_id", "host__name", "host__address", "host__channel_port", "http_port", "queue_ms",
            "host__last_heartbeat",
        )
    )  # fmt: skip
    found = []
    for pk, serial, host_id, host, address, channel_port, port, queue_ms, beat in rows:
        channel = None
        if not pki.is_loopback(address):
            if not channel_port:
                continue
            channel = Channel(server_name=pki.server_name(host_id, port), context=client_context())
        found.append(
            Endpoint(
                replica_id=pk,
                url=f"{address}:{channel_port}" if channel else f"{address}:{port}",
                label=f"r{serial} on {host}",
                queue_ms=queue_ms,
                stale=beat is None or beat < beaten,
                channel=channel,
            )
        )
    return found


@dataclass
class _State:
    in_flight: int = 0
    failures: int = 0  # in a row
    ejected_until: float = 0.0  # monotonic; 0: not ejected
    ejections: int = 0
    on_probation: bool = False  # its cool-off ended; the next answer says whether it is back


class Balancer:
    """This process's view of the replicas it sends requests to."""

    def __init__(self) -> None:
        self._states: dict[int, _State] = {}
        self._turn = itertools.count()

    def _state(self, replica_id: int) -> _State:
        return self._states.setdefault(replica_id, _State())

    def pick(self, endpoints: list[Endpoint], *, avoid: frozenset[int] = frozenset()) -> Endpoint | None:
        """The endpoint to send the next request to, or None when every one is
        avoided. Ejected ones, then those on hosts that stopped beating, are
        taken only when nothing better is left."""
        now = time.monotonic()
        usable = [e for e in endpoints if e.replica_id not in avoid]
        if not usable:
            return None
        admitted = [e for e in usable if self._state(e.replica_id).ejected_until <= now]
        pool = [e for e in admitted if not e.stale] or admitted or usable
        turn = next(self._turn)
        chosen = min(
            pool,
            key=lambda e: (
                self._state(e.replica_id).in_flight,
                round(e.queue_ms, 1),
                (pool.index(e) - turn) % len(pool),
            ),
        )
        state = self._state(chosen.replica_id)
        if state.ejected_until and state.ejected_until <= now:
            state.ejected_until, state.on_probation = 0.0, True
        return chosen

    def begin(self, endpoint: Endpoint) -> None:
        self._state(endpoint.replica_id).in_flight += 1

    def end(self, endpoint: Endpoint, *, failed: bool) -> str:
        """Count a finished request; what to say on the replica's timeline (or "")."""
        state = self._state(endpoint.replica_id)
        state.in_flight = max(0, state.in_flight - 1)
        if not failed:
            state.failures = 0
            if state.on_probation:
                state.on_probation = False
                return "answered again after its cool-off: routed to again"
            return ""
        state.failures += 1
        if state.on_probation or state.failures >= settings.GANTRY_EJECT_AFTER_FAILURES:
            state.on_probation = False
            state.ejected_until = time.monotonic() + settings.GANTRY_EJECT_COOLOFF_S
            state.ejections += 1
            failures, state.failures = state.failures, 0
            return (
                f"ejected by a gateway process after {failures} failed request(s) in a row: no requests "
                f"for {settings.GANTRY_EJECT_COOLOFF_S}s, then tried again"
            )
        return ""

    def figures(self, replica_id: int) -> dict[str, Any]:
        """What this process knows of a replica: requests in flight, ejections, whether it is ejected now."""
        state = self._states.get(replica_id, _State())
        return {
            "in_flight": state.in_flight,
            "ejections": state.ejections,
            "ejected": state.ejected_until > time.monotonic(),
        }


balancer = Balancer()


def _say(endpoint: Endpoint, message: str) -> None:
    """Put a balancing decision on the replica's timeline, without holding the request up."""

    def write() -> None:
        try:
            record_replica_event(
                replica_id=endpoint.replica_id, kind="replica.balancing", source="gateway", message=message
            )
        except Exception:  # noqa: BLE001 - a lost note never fails a request
            log.warning("could not note on %s's timeline: %s", endpoint.label, message, exc_info=True)

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        write()
        return
    task = loop.create_task(sync_to_async(write, thread_sensitive=False)())
    _notes.add(task)
    task.add_done_callback(_notes.discard)


_notes: set[asyncio.Task] = set()


def finish(endpoint: Endpoint, *, failed: bool) -> None:
    """Count a finished request on ``endpoint`` (and say an ejection or a return)."""
    if note := balancer.end(endpoint, failed=failed):
        _say(endpoint, note)


def unavailable(endpoints: list[Endpoint]) -> TransientError:
    return TransientError("no replica answers: " + (", ".join(e.label for e in endpoints) or "none is ready"))


class Tries:
    """The replicas one request goes to: the best, and after a TransientError
    before any answer, once another. Every door's request loop runs on this."""

    def __init__(self, endpoints: list[Endpoint]) -> None:
        self.endpoints = endpoints
        self.tried: frozenset[int] = frozenset()

    def next(self) -> Endpoint:
        """The replica to send to now (counted in flight); TransientError when none is left."""
        endpoint = balancer.pick(self.endpoints, avoid=self.tried)
        if endpoint is None:
            raise unavailable(self.endpoints)
        balancer.begin(endpoint)
        return endpoint

    def failed(self, endpoint: Endpoint, error: TransientError) -> None:
        """``endpoint`` failed before answering: raise ``error`` unless another may be tried."""
        finish(endpoint, failed=True)
        self.tried |= {endpoint.replica_id}
        if len(self.tried) >= 2 or len(self.tried) >= len(self.endpoints):
            raise error

    @staticmethod
    def answered(endpoint: Endpoint) -> None:
        """``endpoint`` answered (or refused, or the caller went away): it is not failing."""
        finish(endpoint, failed=False)

    @contextmanager
    def attempt(self) -> Iterator[Endpoint]:
        """One try: the replica to send to, counted as it ends. A TransientError
        in the block is swallowed while another replica may be tried (the
        caller's loop tries it), else raised."""
        endpoint = self.next()
        try:
            yield endpoint
        except TransientError as error:
            self.failed(endpoint, error)
            return
        except BaseException:
            self.answered(endpoint)
            raise
        self.answered(endpoint)


async def call(endpoints: list[Endpoint], request: Callable[[Endpoint], Awaitable[T]]) -> T:
    """``request`` on the best replica; on a TransientError, once more on another."""
    tries = Tries(endpoints)
    while True:
        with tries.attempt() as endpoint:
            return await request(endpoint)
