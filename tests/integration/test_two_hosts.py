"""Two GPU hosts for real: two workers, each in a network namespace of its
own with its own address (reaching PostgreSQL and Redis over a veth pair, as
a second machine would over the network), each serving a deployment on the
same port numbers. Killing one host's worker leaves the other serving; the
dead host's deployment shows unknown, and converges when its worker returns."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.integration.conftest import fleet, wait_for
from workers.runtimes import process

pytestmark = [pytest.mark.integration]


def test_two_hosts_serve_apart_and_one_losing_its_worker_leaves_the_other_serving(
    tmp_path: Path, minilm_path: Path, page
):  # noqa: ANN001
    with fleet(tmp_path, 2) as plane:
        hosts, base, http, get, workers = plane.hosts, plane.base, plane.session(), plane.get, plane.workers

        def inspection(model: str) -> str:
            return next(m["inspection"] for m in get("/api/models/?limit=500")["results"] if m["name"] == model)

        def host_row(name: str) -> dict:
            return next((h for h in get("/api/hosts/")["results"] if h["name"] == name), {})

        assert {host_row(n)["address"] for n in hosts} == {ns.address for ns in hosts.values()}

        deployment = {}
        for name in hosts:
            model = f"minilm-{name}"
            body = {"name": model, "kind": "embedding", "path": str(minilm_path), "host": name}
            assert http.post(f"{base}/api/models/", json=body, timeout=30).status_code == 201
            wait_for(lambda m=model: inspection(m) == "ready", 60, f"the inspection of {model}")
            body = {"name": f"on-{name}", "host": name, "models": [{"model": model}]}
            created = http.post(f"{base}/api/deployments/", json=body, timeout=30).json()
            deployment[name] = created["id"]
            assert http.post(f"{base}/api/deployments/{created['id']}/start/", timeout=30).status_code == 202

        def shown(name: str) -> str:
            return get(f"/api/deployments/{deployment[name]}/")["shown_status"]

        def embeds(name: str) -> bool:
            body = {"texts": ["two hosts"], "model": f"minilm-{name}"}
            answer = http.post(f"{base}/api/deployments/{deployment[name]}/embed/", json=body, timeout=30)
            return answer.status_code == 200 and len(answer.json()["embeddings"][0]) == 384

        for name in hosts:
            wait_for(lambda n=name: shown(n) == "ready", 240, f"the deployment on {name}")
        ports = {get(f"/api/deployments/{deployment[n]}/")["replica_set"][0]["http_port"] for n in hosts}
        assert len(ports) == 1  # the same port on two hosts: each has its own address
        assert embeds("host-a") and embeds("host-b")  # the web reaches each host's Triton at its address

        # The dashboard, open in a browser, follows what happens next without a reload.
        from playwright.sync_api import expect

        page.goto(f"{base}/")
        page.fill("input[name=username]", "ops")
        page.fill("input[name=password]", "ops-pass")
        page.click("button[type=submit]")
        expect(page.locator("#live-indicator")).to_have_text("live")

        def badge(name: str):  # noqa: ANN202
            return page.locator(f"[data-deployment='{deployment[name]}'] [data-status]")

        expect(badge("host-a")).to_have_text("ready")

        os.killpg(workers["host-a"].pid, signal.SIGKILL)  # host A loses its worker
        workers["host-a"].wait()
        wait_for(lambda: shown("host-a") == "unknown", 30, "host A's deployment to show unknown")
        kinds = lambda: [e["kind"] for e in get("/api/events/?host=host-a&limit=100")["results"]]  # noqa: E731
        wait_for(lambda: "host.offline" in kinds(), 30, "the sweep to mark host A offline")
        expect(badge("host-a")).to_have_text("unknown", timeout=10_000)
        expect(page.locator("[data-host='host-a'] [data-status]")).to_have_text("offline")
        expect(badge("host-b")).to_have_text("ready")
        page.screenshot(path=str(tmp_path / "dashboard-host-offline.png"), full_page=True)
        assert shown("host-b") == "ready" and embeds("host-b")  # the other host serves on
        assert embeds("host-a")  # host A's Triton itself kept serving without its worker

        plane.start_worker("host-a")
        wait_for(lambda: shown("host-a") == "ready", 60, "host A's deployment to converge")
        expect(badge("host-a")).to_have_text("ready", timeout=10_000)
        expect(page.locator("[data-host='host-a'] [data-status]")).to_have_text("online")
        # Shown ready as soon as the host beats again; its reconcile says what it adopted a moment later.
        timeline = lambda: [e["kind"] for e in get(f"/api/deployments/{deployment['host-a']}/events/?limit=500")[  # noqa: E731
            "results"]]  # fmt: skip
        wait_for(lambda: "deployment.adopted" in timeline(), 30, "host A's worker to adopt the running Triton")
        assert "host.online" in kinds()
        for name in hosts:
            http.post(f"{base}/api/deployments/{deployment[name]}/stop/", timeout=30)
        for name in hosts:
            wait_for(lambda n=name: shown(n) == "stopped", 60, f"the deployment on {name} to stop")
        for name in hosts:
            assert process.servers_under(tmp_path / name) == []
