"""Replicas across three hosts for real: one alias, three Tritons in three
network namespaces. Eight clients embed through the gateway while one host's
worker and tritonserver are SIGKILLed: every request succeeds (a failed one
is retried on another replica), the lost replica is replaced on a host with
room within the grace period plus one start, and the killed host's return
leaves no surplus."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.integration.conftest import fleet, wait_for
from workers.runtimes import process

pytestmark = [pytest.mark.integration]

GRACE_S = 8


def test_an_alias_keeps_answering_while_a_host_dies_and_its_replica_comes_back_elsewhere(
    tmp_path: Path, minilm_path: Path
):
    with fleet(tmp_path, 3, {"GANTRY_HOST_LOST_GRACE_S": str(GRACE_S)}) as plane:
        http = plane.session()
        base = plane.base
        body = {"name": "minilm", "kind": "embedding", "path": str(minilm_path), "host": "host-a"}
        assert http.post(f"{base}/api/models/", json=body, timeout=30).status_code == 201
        wait_for(lambda: plane.get("/api/models/?name=minilm")["results"][0]["inspection"] == "ready", 60, "inspection")
        body = {"name": "svc", "replicas": 3, "models": [{"model": "minilm", "max_batch_size": 8}]}
        created = http.post(f"{base}/api/deployments/", json=body, timeout=30).json()
        url = f"{base}/api/deployments/{created['id']}/"
        started = http.post(f"{url}start/", timeout=30)
        assert started.status_code == 202, started.text
        # Spread: one replica on each host.
        assert sorted(r["host"] for r in started.json()["replica_set"]) == ["host-a", "host-b", "host-c"]
        wait_for(lambda: plane.get(url[len(base) :])["status"] == "ready", 240, "three replicas ready")
        alias = {"name": "embed", "deployment": created["id"], "model": "minilm"}
        assert http.post(f"{base}/api/gateway/aliases/", json=alias, timeout=30).status_code == 201
        key = http.post(f"{base}/api/gateway/keys/", json={"name": "load", "all_aliases": True}, timeout=30).json()
        headers = {"Authorization": f"Bearer {key['key']}"}

        outcomes: list[int] = []
        stop = threading.Event()

        def client() -> None:
            session = requests.Session()
            while not stop.is_set():
                answer = session.post(f"{base}/v1/embeddings", json={"model": "embed", "input": ["a host dies"]},
                                      headers=headers, timeout=30)  # fmt: skip
                outcomes.append(answer.status_code)

        clients = [threading.Thread(target=client) for _ in range(8)]
        for thread in clients:
            thread.start()
        try:
            wait_for(lambda: len(outcomes) >= 40, 60, "the load to run")
            doomed = next(r for r in plane.get(url[len(base) :])["replica_set"] if r["host"] == "host-c")
            [(server, _)] = process.servers_under(tmp_path / "host-c")
            os.killpg(plane.workers["host-c"].pid, signal.SIGKILL)  # host C's worker...
            os.killpg(int(server), signal.SIGKILL)  # ...and its tritonserver
            killed_at = time.monotonic()
            served_before = len(outcomes)

            def restored() -> bool:
                rows = plane.get(url[len(base) :])["replica_set"]
                ready = [r for r in rows if r["status"] == "ready" and r["host"] != "host-c"]
                return len(ready) == 3

            wait_for(restored, GRACE_S + 120, "a replacement ready on a host with room")
            restored_s = time.monotonic() - killed_at
            wait_for(lambda: len(outcomes) >= served_before + 200, 120, "more load after the replacement")
        finally:
            stop.set()
            for thread in clients:
                thread.join(timeout=60)
        assert outcomes and set(outcomes) == {200}, sorted(set(outcomes))  # not one request failed
        rows = plane.get(url[len(base) :])["replica_set"]
        lost = next(r for r in rows if r["serial"] == doomed["serial"])
        assert lost["status"] == "lost"
        replacement = max(rows, key=lambda r: r["serial"])
        assert replacement["host"] in ("host-a", "host-b") and replacement["status"] == "ready"
        # Within the grace period plus one start (the start of one MiniLM Triton on a busy CPU: 90 s here).
        assert restored_s < GRACE_S + 90, restored_s

        # Host C comes back; its server is gone, so its replica is stopped and removed: three, no surplus.
        plane.start_worker("host-c")
        wait_for(lambda: len(plane.get(url[len(base) :])["replica_set"]) == 3, 60, "the surplus to be removed")
        rows = plane.get(url[len(base) :])["replica_set"]
        assert all(r["status"] == "ready" for r in rows) and doomed["serial"] not in [r["serial"] for r in rows]
        timeline = [e["kind"] for e in plane.get(f"/api/deployments/{created['id']}/events/?limit=200")["results"]]
        assert "replica.removed" in timeline and timeline.count("deployment.scaled") == 0
        http.post(f"{url}stop/", timeout=30)
        wait_for(lambda: plane.get(url[len(base) :])["status"] == "stopped", 90, "the stop")
