"""The walking skeleton end to end, with real processes: REST -> Celery worker
-> tritonserver -> readiness -> websocket event -> inference -> stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from core.models import Event
from deployments.models import Deployment, MetricSample
from deployments.services import replica_placement
from hosts.models import GpuHost
from tests import factories
from tests.integration.conftest import Stack, wait_for
from workers import processes
from workers.runtimes import process

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

SENTENCES = ["A man is playing a guitar.", "Someone plays an instrument.", "The stock market fell sharply today."]


def _register_and_create(stack: Stack, minilm_path: Path) -> dict:
    http = stack.session()
    stack.register_models(minilm_path, minilm="embedding")
    created = http.post(
        f"{stack.web_url}/api/deployments/",
        json={
            "name": "e2e",
            "host": stack.host_name,
            "models": [{"model": "minilm", "max_batch_size": 16, "preferred_batch_sizes": [4, 8]}],
        },
        timeout=30,
    )
    assert created.status_code == 201, created.text
    return created.json()


def _socket(stack: Stack, deployment_id: int):
    return connect(
        f"{stack.ws_url}/ws/deployments/{deployment_id}/",
        additional_headers={"Authorization": f"Bearer {stack.token}", "Origin": stack.web_url},
        open_timeout=10,
    )


def _wait_for_status(socket, wanted: str, timeout_s: float) -> list[dict]:
    """Receive events until one moves the deployment to ``wanted``; return all seen."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        event = json.loads(socket.recv(timeout=max(0.1, deadline - time.monotonic())))
        if event["type"] != "event" or event.get("kind") == "replica.status":
            continue  # metrics and log lines share the socket; the deployment's status sums its replica's
        seen.append(event)
        if event.get("to_status") == wanted:
            return seen
        if event.get("to_status") == "failed" and wanted != "failed":
            pytest.fail(f"deployment failed: {event['message']}\n{event['data'].get('log_tail', '')}")
    pytest.fail(f"no {wanted} event within {timeout_s}s; saw {[e.get('to_status') for e in seen]}")


def _server_log(stack: Stack, deployment_id: int) -> list[str]:
    page = stack.session().get(f"{stack.web_url}/api/deployments/{deployment_id}/log/?limit=500", timeout=30).json()
    return [row["line"] for row in reversed(page["results"])]


def _stop(stack: Stack, deployment_id: int) -> None:
    assert stack.session().post(f"{stack.web_url}/api/deployments/{deployment_id}/stop/", timeout=30).status_code == 202
    wait_for(lambda: Deployment.objects.get(pk=deployment_id).status == "stopped", 60, "the stop")


def test_deployment_goes_ready_serves_embeddings_and_stops_cleanly(stack: Stack, minilm_path: Path):
    deployment = _register_and_create(stack, minilm_path)
    http = stack.session()
    with _socket(stack, deployment["id"]) as socket:
        started = http.post(f"{stack.web_url}/api/deployments/{deployment['id']}/start/", timeout=30)
        assert started.status_code == 202, started.text
        seen = _wait_for_status(socket, "ready", timeout_s=240)
    assert [e["to_status"] for e in seen if e["to_status"]] == ["launching", "loading", "ready"]

    row = factories.replica_row(deployment["id"])
    pid = int(row.runtime_handle)
    repository = stack.data_dir / "deployments" / f"{row.deployment_id}-{row.deployment.name}" / "r1" / "repository"
    assert process.is_running(row.runtime_handle, repository)

    # The agent ships the server's log lines to the control plane.
    wait_for(
        lambda: any("successfully loaded 'minilm'" in line for line in _server_log(stack, row.deployment_id)),
        30,
        "the server log to arrive",
    )

    # Triton's repository API answers only with the deployment's secret.
    index_url = f"http://127.0.0.1:{row.http_port}/v2/repository/index"
    assert requests.post(index_url, timeout=10).status_code == 403
    allowed = requests.post(index_url, headers={"gantry-admin-key": row.deployment.admin_secret}, timeout=10)
    assert allowed.status_code == 200 and allowed.json()[0]["state"] == "READY"
    # Every port of the server binds loopback only (the web tier on another machine goes
    # through the host's channel), and the secret is in no environment model code inherits.
    listening = subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True, check=True).stdout
    ours = [
        line.split()[3].replace("[::ffff:127.0.0.1]", "127.0.0.1")
        for line in listening.splitlines()
        if f"pid={pid}," in line
    ]  # fmt: skip (gRPC listens on IPv4-mapped IPv6: loopback all the same)
    assert sorted(ours) == sorted(f"127.0.0.1:{p}" for p in (row.http_port, row.grpc_port, row.metrics_port)), ours
    stubs = set(processes.group_members(pid)) - {pid}
    assert stubs, "the python model runs in a stub process of the server"
    for stub in stubs:
        assert row.deployment.admin_secret.encode() not in Path(f"/proc/{stub}/environ").read_bytes()
    # Nor do the server and the model code it runs see the worker's own settings.
    for member in (pid, *stubs):
        names = {item.split(b"=", 1)[0] for item in Path(f"/proc/{member}/environ").read_bytes().split(b"\0")}
        assert not names & {b"DATABASE_URL", b"SECRET_KEY", b"REDIS_URL", b"DJANGO_SETTINGS_MODULE"}, member

    # The agent scrapes the server's metrics port once it is ready.
    wait_for(
        lambda: MetricSample.objects.filter(deployment=row.deployment, subject="minilm").exists(), 30, "a first scrape"
    )

    # Straight to Triton with tritonclient: 384 numbers per sentence, unit length.
    client = httpclient.InferenceServerClient(f"127.0.0.1:{row.http_port}")
    batch = np.array([[s.encode()] for s in SENTENCES], dtype=object)
    request = httpclient.InferInput("TEXT", list(batch.shape), "BYTES")
    request.set_data_from_numpy(batch)
    vectors = client.infer("minilm", [request]).as_numpy("EMBEDDING")
    client.close()
    assert vectors.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)

    # And through Gantry's playground endpoint, as the browser does.
    played = http.post(
        f"{stack.web_url}/api/deployments/{row.deployment_id}/embed/", json={"texts": SENTENCES}, timeout=60
    )
    assert played.status_code == 200, played.text
    similarity = np.array(played.json()["similarity"])
    np.testing.assert_allclose(np.array(played.json()["embeddings"]), vectors, atol=1e-5)
    assert similarity[0, 1] > similarity[0, 2] + 0.2  # the two music sentences are the close pair

    # Two requests later the scrape shows them, as a total and as a rate.
    counted = wait_for(
        lambda: MetricSample.objects.filter(
            deployment=row.deployment, subject="minilm", values__requests_total__gte=2
        ).first(),
        30,
        "a scrape counting the two requests",
    )
    assert counted.values["request_rate"] > 0 and counted.values["failures_total"] == 0
    assert counted.values["compute_ms"] > 0
    api_samples = http.get(
        f"{stack.web_url}/api/deployments/{row.deployment_id}/metrics/?minutes=5&kind=model", timeout=30
    )
    assert any(s["subject"] == "minilm" and s["values"]["requests_total"] >= 2 for s in api_samples.json()["results"])

    # A second start is refused and changes nothing.
    again = http.post(f"{stack.web_url}/api/deployments/{row.deployment_id}/start/", timeout=30)
    assert again.status_code == 409

    with _socket(stack, row.deployment_id) as socket:
        stopped = http.post(f"{stack.web_url}/api/deployments/{row.deployment_id}/stop/", timeout=30)
        assert stopped.status_code == 202
        _wait_for_status(socket, "stopped", timeout_s=60)
    row.refresh_from_db()
    assert row.status == "stopped" and row.runtime_handle == ""
    assert not process.is_running(str(pid), repository)
    assert processes.group_members(pid) == []  # no tritonserver or python stub left


def test_embedder_and_reranker_share_one_server(stack: Stack, minilm_path: Path):
    http = stack.session()
    stack.register_models(minilm_path, minilm="embedding", **{"minilm-rerank": "reranker"})
    created = http.post(
        f"{stack.web_url}/api/deployments/",
        json={
            "name": "pair",
            "host": stack.host_name,
            "models": [
                {"model": "minilm", "priority_levels": 2, "default_priority_level": 2, "queue_timeout_us": 5_000_000},
                {"model": "minilm-rerank", "max_queue_size": 32},
            ],
        },
        timeout=30,
    )
    assert created.status_code == 201, created.text
    deployment_id = created.json()["id"]
    with _socket(stack, deployment_id) as socket:
        http.post(f"{stack.web_url}/api/deployments/{deployment_id}/start/", timeout=30)
        _wait_for_status(socket, "ready", timeout_s=240)

    passages = ["Bananas are rich in potassium.", "Triton serves models over HTTP and gRPC."]
    ranked = http.post(
        f"{stack.web_url}/api/deployments/{deployment_id}/rerank/",
        json={"query": "How does Triton serve models?", "passages": passages},
        timeout=60,
    )
    assert ranked.status_code == 200, ranked.text
    assert ranked.json()["order"] == [1, 0]
    # The reranker's score is the cosine of the embedder's vectors: both models answer from one server.
    vectors = np.array(
        http.post(
            f"{stack.web_url}/api/deployments/{deployment_id}/embed/",
            json={"texts": ["How does Triton serve models?", *passages]},
            timeout=60,
        ).json()["embeddings"]
    )
    np.testing.assert_allclose(ranked.json()["scores"], vectors[1:] @ vectors[0], atol=1e-4)
    wrong = http.post(
        f"{stack.web_url}/api/deployments/{deployment_id}/rerank/",
        json={"query": "q", "passages": ["p"], "model": "minilm"},
        timeout=30,
    )
    assert wrong.status_code == 400 and "serves no reranker model named 'minilm'" in wrong.json()["detail"]
    _stop(stack, deployment_id)


def test_launch_on_a_taken_port_fails_with_the_port_named(stack: Stack, minilm_path: Path):
    http = stack.session()
    stack.register_models(minilm_path, minilm="embedding")
    # The ports the replica will be given (the lowest free triple of the range), taken by another program.
    taken, _, _ = replica_placement.allocate_ports(GpuHost.objects.get(name=stack.host_name))
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        created = http.post(
            f"{stack.web_url}/api/deployments/",
            json={"name": "squatted", "host": stack.host_name, "models": [{"model": "minilm"}]},
            timeout=30,
        )
        assert created.status_code == 201, created.text
        with _socket(stack, created.json()["id"]) as ws:
            http.post(f"{stack.web_url}/api/deployments/{created.json()['id']}/start/", timeout=30)
            seen = _wait_for_status(ws, "failed", timeout_s=30)
    assert f"port(s) {taken} on {stack.host_name} are already in use" in seen[-1]["message"]
    assert process.servers_under(stack.data_dir) == []


def test_crashed_tritonserver_is_noticed_and_restarted(stack: Stack, minilm_path: Path):
    deployment = _register_and_create(stack, minilm_path)
    http = stack.session()
    with _socket(stack, deployment["id"]) as socket:
        http.post(f"{stack.web_url}/api/deployments/{deployment['id']}/start/", timeout=30)
        _wait_for_status(socket, "ready", timeout_s=240)
        first_pid = int(factories.replica_row(deployment["id"]).runtime_handle)
        os.killpg(first_pid, signal.SIGKILL)  # the server dies under us
        seen = _wait_for_status(socket, "failed", timeout_s=30)
        assert seen[-1]["message"].startswith("tritonserver exited unexpectedly: killed by SIGKILL")
        assert seen[-1]["data"]["exit"] == {"returncode": -9, "oom_killed": False, "signal": 9}
        _wait_for_status(socket, "ready", timeout_s=240)
    row = factories.replica_row(deployment["id"])
    assert int(row.runtime_handle) != first_pid
    assert Event.objects.filter(deployment=row.deployment, kind="deployment.crash_restart").count() == 1
    _stop(stack, row.deployment_id)


def test_worker_killed_while_loading_converges_after_restart(stack: Stack, minilm_path: Path):
    deployment = _register_and_create(stack, minilm_path)
    http = stack.session()
    with _socket(stack, deployment["id"]) as socket:
        http.post(f"{stack.web_url}/api/deployments/{deployment['id']}/start/", timeout=30)
        _wait_for_status(socket, "loading", timeout_s=60)
        os.killpg(stack.worker.pid, signal.SIGKILL)  # the worker dies mid-launch; its server lives on
        stack.worker.wait()
        server_pid = factories.replica_row(deployment["id"]).runtime_handle
        stack.start_worker()
        seen = _wait_for_status(socket, "ready", timeout_s=240)
    assert seen[-1]["source"] == f"worker:{stack.host_name}"
    row = factories.replica_row(deployment["id"])
    assert row.runtime_handle == server_pid  # the restarted worker adopted the server, started no second one
    assert [h for h, _ in process.servers_under(stack.data_dir)] == [server_pid]
    _stop(stack, row.deployment_id)


def test_websocket_refuses_anonymous_clients(stack: Stack):
    with pytest.raises(InvalidStatus) as refused:
        with connect(f"{stack.ws_url}/ws/dashboard/", additional_headers={"Origin": stack.web_url}):
            pass
    assert refused.value.response.status_code == 403


def test_websocket_refuses_foreign_origins(stack: Stack):
    headers = {"Authorization": f"Bearer {stack.token}", "Origin": "http://evil.example"}
    with pytest.raises(InvalidStatus) as refused:
        with connect(f"{stack.ws_url}/ws/dashboard/", additional_headers=headers):
            pass
    assert refused.value.response.status_code == 403
