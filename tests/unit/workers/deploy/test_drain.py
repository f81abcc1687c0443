"""A draining replica's host waits on what its server holds, read from a real
metrics endpoint (a local HTTP server standing in for Triton's port): until
nothing is in flight, or until its deadline, and says which on the timeline."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.utils import timezone

from core.models import Event
from deployments import states
from deployments.models import Replica
from deployments.services import deployments
from deployments.services.placements import PlacementSpec
from tests import factories
from workers.deploy import drain

TEXT = """\
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="llm",version="1"} 0
# TYPE gantry_requests_in_flight gauge
gantry_requests_in_flight{model="llm",model_instance="llm_0_0"} %d
"""


class _Metrics(BaseHTTPRequestHandler):
    held = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = (TEXT % type(self).held).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[type[_Metrics]]:
    handler = type("Metrics", (_Metrics,), {"held": 0})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    handler.port = httpd.server_address[1]
    yield handler
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def stopping(settings, gpu_host, minilm, operator, server, monkeypatch) -> Replica:  # noqa: ANN001
    settings.GANTRY_HOST_NAME = gpu_host.name
    monkeypatch.setattr(drain, "ROUTES_SETTLE_S", 0.3)
    monkeypatch.setattr(drain, "TELL_EVERY_S", 0.0)
    factories.surveyed()
    deployment = deployments.deployment_create(
        name="d", hosts=[gpu_host.name], placements=[PlacementSpec(model="minilm")], user=operator
    )
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    replica = factories.replica_of(deployment)
    Replica.objects.filter(pk=replica.pk).update(metrics_port=server.port)
    states.replica_transition(replica_id=replica.pk, to="loading", source="t", runtime_handle="4242")
    states.replica_transition(replica_id=replica.pk, to="ready", source="t")
    deployments.deployment_stop(deployment_id=deployment.pk, user=operator)
    return Replica.objects.select_related("deployment", "host").get(pk=replica.pk)


def _said(replica: Replica) -> list[str]:
    rows = Event.objects.filter(deployment_id=replica.deployment_id, kind="replica.draining").order_by("id")
    return [message.split(": ", 1)[1] for message in rows.values_list("message", flat=True)]


def test_the_host_waits_until_its_server_holds_nothing(stopping, server):
    server.held = 2
    threading.Timer(0.6, lambda: setattr(server, "held", 0)).start()
    drain.drain(stopping, stopping.drain_until, why="stopping")
    said = _said(stopping)
    assert said[0].startswith("draining (stopping): 2 request(s) in flight, up to")
    assert said[-1].startswith("drained in") and said[-1].endswith("no request in flight")
    row = Replica.objects.get(pk=stopping.pk)
    assert (row.in_flight, row.drain_until) == (0, None)


def test_at_its_deadline_the_host_stops_waiting_and_says_what_is_cut(stopping, server):
    server.held = 3
    drain.drain(stopping, timezone.now() + timedelta(seconds=0.8), why="stopping")
    said = _said(stopping)[-1]
    assert said.startswith("drain timeout after") and said.endswith("the 3 request(s) still in flight are cut")


def test_a_server_whose_metrics_do_not_answer_is_not_waited_on(stopping, server):
    Replica.objects.filter(pk=stopping.pk).update(metrics_port=_closed_port())
    replica = Replica.objects.select_related("deployment", "host").get(pk=stopping.pk)
    drain.drain(replica, replica.drain_until, why="stopping")
    assert _said(replica)[-1].startswith("drain ended: its server's metrics do not answer")


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
