"""Draining: a replica's server answers the requests it holds before it stops.

The control plane takes a replica out of balancing first (a stopping replica
is not answering, and every door's route cache forgets it within its second),
then its host waits here until the server holds no request, or until the
replica's drain deadline, before the server is stopped. What the server holds
is read from its own metrics port (triton_server.metrics.in_flight: Triton's
queued requests and those its generating models took in), every quarter of a
second; the count is on the replica's row and its timeline while it drains.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime

from django.utils import timezone

from common.errors import TransientError
from deployments.models import Replica
from deployments.services import replicas
from triton_server import metrics
from workers.jobs import source

log = logging.getLogger(__name__)

POLL_S = 0.25
# Each door keeps a deployment's answering replicas for up to a second (common.ttl_cache);
# a request routed just before the replica left balancing may reach its server until
# then. A server found empty sooner than this after the replica left is waited on.
ROUTES_SETTLE_S = 2.0
# How often the count is told on the timeline while it changes.
TELL_EVERY_S = 2.0


def drain(replica: Replica, until: datetime | None, *, why: str) -> None:
    """Wait until ``replica``'s server holds no request, or until ``until``
    (none: no wait). Said on its timeline: how it ended, and what it held."""
    if until is None or not replica.runtime_handle:
        return
    url = metrics.local_url(replica.metrics_port)
    started = time.monotonic()
    # It left balancing when it moved (the control plane's clock: it set the deadline too).
    settled_at = started + ROUTES_SETTLE_S - max(0.0, (timezone.now() - replica.status_changed_at).total_seconds())
    told, told_at, held = -1, 0.0, 0
    while True:
        try:
            held = metrics.in_flight(metrics.scrape(url, timeout_s=2.0))
        except TransientError as exc:
            _ended(replica, f"drain ended: its server's metrics do not answer ({exc})")
            return
        left = (until - timezone.now()).total_seconds()
        if (held == 0 and time.monotonic() >= settled_at) or left <= 0:
            break
        if held != told and time.monotonic() - told_at >= TELL_EVERY_S:
            replicas.replica_drain_told(
                replica_id=replica.pk, in_flight=held, source=source(),
                message=f"draining ({why}): {held} request(s) in flight, up to {left:.0f}s more",
            )  # fmt: skip
            told, told_at = held, time.monotonic()
        time.sleep(POLL_S)
    waited = time.monotonic() - started
    if held:
        _ended(replica, f"drain timeout after {waited:.0f}s: the {held} request(s) still in flight are cut")
    else:
        _ended(replica, f"drained in {waited:.1f}s: no request in flight")


def _ended(replica: Replica, message: str) -> None:
    log.info("replica %s: %s", replica.pk, message)
    replicas.replica_drain_told(replica_id=replica.pk, in_flight=0, source=source(), message=message, ended=True)
