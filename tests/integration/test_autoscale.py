"""Autoscaling on a real fleet, under load, dropping nothing. Two hosts in
network namespaces, each with its own worker and tritonserver; the tiny LLM
(a checkpoint made here, untrained) behind one alias, autoscaling 1..2 on
requests in flight (target 6). Four clients of our own stream chat completions
through /v1 the whole time, and AIPerf adds eight more streams for a minute,
as a Gantry load test configures it. Load up: one replica holds about twelve,
twice the target, and the autoscaler adds the second within the stated
number of cooldowns. Load off: four streams on two replicas are a third of
the target, so it removes one replica, and only one, which leaves balancing
and drains before its server stops (test_drain fills a retired replica's
queue on purpose; here whether one still runs then is chance). AIPerf counts
no error, and every stream of ours ends with its finish_reason and [DONE].
The model's page lists both hosts as holding its files."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from tests.integration.conftest import fleet, start_aiperf, wait_for
from tests.sse import StreamEnd, chat_stream
from workers.loadtest.results import records_of

pytestmark = [pytest.mark.integration]

COOLDOWN_S = 10
TARGET = 6
CLIENTS = 4  # our own streams, throughout: below the target on two replicas, within it on one
LOAD = 8  # AIPerf's streams on top, for LOAD_S
LOAD_S = 60
# The sweep reads each replica's figures every beat (1 s here); a change waits out the cooldown since
# the last one. Added within this many cooldowns of the load showing on the replica's server:
COOLDOWNS_TO_ADD = 3


def test_load_adds_a_replica_and_its_end_removes_one_drained_with_no_failed_or_cut_request(
    tmp_path: Path,
    tiny_llm: Path,
    page,
    screenshot,  # noqa: ANN001
):
    with fleet(tmp_path, 2) as plane:
        http = plane.session()
        base = plane.base
        plane.register("tiny", "llm", tiny_llm, "host-a")
        body = {
            "name": "chat", "replicas": 1, "drain_timeout_s": 300, "models": [{"model": "tiny"}],
            "autoscale": {"min_replicas": 1, "max_replicas": 2, "metric": "in_flight", "target": TARGET,
                          "cooldown_s": COOLDOWN_S},
        }  # fmt: skip
        created = http.post(f"{base}/api/deployments/", json=body, timeout=30)
        assert created.status_code == 201, created.text
        path = f"/api/deployments/{created.json()['id']}/"
        assert http.post(f"{base}{path}start/", timeout=30).status_code == 202
        wait_for(lambda: plane.get(path)["status"] == "ready", 300, "the first replica ready", interval_s=0.5)
        alias = {"name": "chat", "deployment": created.json()["id"], "model": "tiny"}
        assert http.post(f"{base}/api/gateway/aliases/", json=alias, timeout=30).status_code == 201
        key = http.post(f"{base}/api/gateway/keys/", json={"name": "load", "all_aliases": True}, timeout=30).json()

        ended: list[StreamEnd] = []
        stop = threading.Event()

        def client(index: int) -> None:
            body = {"model": "chat", "messages": [{"role": "user", "content": f"A long story, number {index}."}],
                    "max_tokens": 256}  # fmt: skip
            while not stop.is_set():
                ended.append(chat_stream(f"{base}/v1/chat/completions", key["key"], body, timeout_s=600))

        clients = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for thread in clients:
            thread.start()
        aiperf = start_aiperf(
            tmp_path / "aiperf", base=base, key=key["key"], tokenizer=tiny_llm, kind="llm", alias="chat",
            workload={"mode": "concurrency", "levels": [LOAD], "duration_s": LOAD_S, "output_tokens": 64},
        )  # fmt: skip
        try:
            # The load is there once the replica's server reports it (AIPerf takes a while to start):
            # from then, the cooldowns count.
            def loaded() -> bool:
                rows = plane.get(path)["replica_set"]
                return len(rows) > 1 or rows[0]["in_flight"] > TARGET * 1.1

            wait_for(loaded, 240, "AIPerf's load on the replica", interval_s=0.5)
            load_seen = datetime.now(timezone.utc)
            # Load up: a second replica, ready while AIPerf still runs.
            two_ready = lambda: sum(r["status"] == "ready" for r in plane.get(path)["replica_set"]) == 2  # noqa: E731
            wait_for(two_ready, COOLDOWNS_TO_ADD * COOLDOWN_S + 240, "the autoscaler's second replica ready")
            assert aiperf.wait(timeout=LOAD_S + 180) == 0, (tmp_path / "aiperf" / "aiperf.log").read_text()[-3000:]
            # Load off (our four streams go on): one replica removed, drained.
            wait_for(lambda: len(plane.get(path)["replica_set"]) == 1, 300 + 60, "a replica removed")
            time.sleep(COOLDOWN_S * 2)  # and no more changes: the one left holds four, within its target
        finally:
            stop.set()
            if aiperf.poll() is None:
                os.killpg(aiperf.pid, signal.SIGKILL)
                aiperf.wait()
            for thread in clients:
                thread.join(timeout=600)

        _, counted = records_of(tmp_path / "aiperf" / "artifacts" / "profile_export.jsonl")
        assert counted["requests"] > 0 and counted["errors"] == 0, counted  # AIPerf: not one failed
        # Ours: not one cut, across the scale-up, the scale-down and the drain.
        assert ended and all(not e.cut for e in ended), [e for e in ended if e.cut]

        timeline = plane.get(f"{path}events/?limit=500")["results"]
        changes = [e for e in timeline if e["kind"] in ("deployment.autoscaled", "deployment.scaled")]
        changes.sort(key=lambda e: e["at"])
        said = "\n".join(f"{e['at']} {e['kind']}: {e['message']}" for e in changes)
        assert [e["kind"] for e in changes] == ["deployment.autoscaled"] * 2, said  # one up, one down
        up, down = changes
        assert up["message"].startswith("replicas 1 → 2"), up
        assert down["message"].startswith("replicas 2 → 1"), down
        assert datetime.fromisoformat(up["at"]) - load_seen < timedelta(seconds=COOLDOWNS_TO_ADD * COOLDOWN_S)
        # The replica removed left balancing, answered what it held, then stopped. Whether it still
        # held a stream when its drain began is the balancer's and the clock's (the tiny model ends
        # a stream in about a second): test_drain fills the retired replica's queue first and checks
        # that its drain counted and answered them.
        rows = plane.get(path)["replica_set"]
        assert len(rows) == 1 and rows[0]["status"] == "ready", rows
        drained = [e["message"] for e in timeline if e["kind"] == "replica.draining"]
        assert any(" drained in " in m for m in drained), drained
        assert not any("cut" in m for m in drained), drained

        # The model's page says which hosts hold its files (where its replicas may go).
        model = plane.get("/api/models/?name=tiny")["results"][0]
        page.goto(f"{base}/models/{model['id']}/")
        page.fill("input[name=username]", "ops")
        page.fill("input[name=password]", "ops-pass")
        page.click("button[type=submit]")
        assert page.inner_text("#copies").startswith("host-a, host-b"), page.inner_text("#copies")
        screenshot("model-held-on")
