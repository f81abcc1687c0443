"""Replicas across three hosts for real: one alias, three Tritons in three
network namespaces. AIPerf drives the alias through the gateway at
concurrency 8, the way Gantry's load tests do. Meanwhile one host flaps
(its worker stopped for less than the grace period, three times), which
causes no churn; then another host's worker and tritonserver are SIGKILLed.
Not one request fails (a failed one is retried on another replica), the lost
replica is replaced on a host with room within the grace period plus one
start, and the killed host's return leaves no surplus."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.integration.conftest import fleet, start_aiperf, wait_for
from workers.loadtest.results import records_of
from workers.runtimes import process

pytestmark = [pytest.mark.integration]

GRACE_S = 8
LOAD_S = 90  # AIPerf's run: the flaps, the kill and the replacement's start fall within it


def test_an_alias_keeps_answering_while_a_host_dies_and_its_replica_comes_back_elsewhere(
    tmp_path: Path, minilm_path: Path
):
    with fleet(tmp_path, 3, {"GANTRY_HOST_LOST_GRACE_S": str(GRACE_S)}) as plane:
        http = plane.session()
        base = plane.base
        plane.register("minilm", "embedding", minilm_path, "host-a")
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

        aiperf = start_aiperf(
            tmp_path / "aiperf",
            base=base,
            key=key["key"],
            tokenizer=minilm_path,
            kind="embedding",
            alias="embed",
            workload={"mode": "concurrency", "levels": [8], "duration_s": LOAD_S},
        )
        try:
            wait_for(lambda: _serving(plane, created["id"]), 120, "AIPerf's load on the replicas")
            serials = sorted(r["serial"] for r in plane.get(url[len(base) :])["replica_set"])
            started_at = plane.get(f"/api/deployments/{created['id']}/events/?limit=1")["results"][0]["at"]
            # Host B flaps: its worker stops beating for less than the grace period, three times.
            for _ in range(3):
                os.killpg(plane.workers["host-b"].pid, signal.SIGSTOP)
                time.sleep(GRACE_S * 0.6)  # shown offline after 3 missed beats, not lost before the grace
                os.killpg(plane.workers["host-b"].pid, signal.SIGCONT)
                time.sleep(3)
            rows = plane.get(url[len(base) :])["replica_set"]
            assert sorted(r["serial"] for r in rows) == serials  # no replacement, nothing removed
            assert all(r["status"] == "ready" for r in rows), rows
            # The timeline of the case: the host went offline and came back three times, and not one
            # replica was lost, placed or removed meanwhile.
            flaps = [e["kind"] for e in plane.get("/api/events/?host=host-b&kind=host.&limit=100")["results"]]
            # On a loaded machine a late beat may show one more flap; what matters is that each was seen
            # and no replica moved (below).
            assert flaps.count("host.offline") >= 3 and flaps.count("host.online") >= 3, flaps
            timeline = plane.get(f"/api/deployments/{created['id']}/events/?limit=500")["results"]
            moved = ("lost", "launching", "stopping")
            churn = [e for e in timeline if e["at"] > started_at and (
                e["kind"] in ("replica.removed", "deployment.scaled")
                or (e["kind"] == "replica.status" and e["to_status"] in moved))]  # fmt: skip
            assert not churn, churn

            doomed = next(r for r in rows if r["host"] == "host-c")
            [(server, _)] = process.servers_under(tmp_path / "host-c")
            os.killpg(plane.workers["host-c"].pid, signal.SIGKILL)  # host C's worker...
            os.killpg(int(server), signal.SIGKILL)  # ...and its tritonserver
            killed_at = time.monotonic()

            def restored() -> bool:
                rows = plane.get(url[len(base) :])["replica_set"]
                ready = [r for r in rows if r["status"] == "ready" and r["host"] != "host-c"]
                return len(ready) == 3

            wait_for(restored, GRACE_S + 120, "a replacement ready on a host with room")
            restored_s = time.monotonic() - killed_at
            assert aiperf.wait(timeout=LOAD_S + 120) == 0, (tmp_path / "aiperf" / "aiperf.log").read_text()[-3000:]
        finally:
            if aiperf.poll() is None:
                os.killpg(aiperf.pid, signal.SIGKILL)
                aiperf.wait()
        _, counted = records_of(tmp_path / "aiperf" / "artifacts" / "profile_export.jsonl")
        assert counted["requests"] > 200 and counted["errors"] == 0, counted  # not one request failed
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


def _serving(plane, deployment_id: int) -> bool:  # noqa: ANN001
    """Every replica's Triton has served requests at the latest scrape."""
    samples = plane.get(f"/api/deployments/{deployment_id}/metrics/?kind=model&ordering=-id&limit=30")["results"]
    busy = {s["replica"] for s in samples if (s["values"].get("request_rate") or 0) > 0}
    return len(busy) >= 3
