"""Two GPU hosts for real: two workers, each in a network namespace of its
own with its own address (reaching PostgreSQL and Redis over a veth pair, as
a second machine would over the network), each serving a deployment on the
same port numbers. Killing one host's worker leaves the other serving; the
dead host's deployment shows unknown, and converges when its worker returns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from controlplane.celery import host_worker_argv
from controlplane.serving import live_argv, web_argv
from tests.integration.conftest import (
    Namespace,
    RedisServer,
    _spawn,
    bootstrap,
    clean_up,
    free_port,
    free_ports,
    healthz_answers,
    namespaces,
    run_postgres,
    stop_process,
    wait_for,
)
from workers.runtimes import process

pytestmark = [pytest.mark.integration]


def test_two_hosts_serve_apart_and_one_losing_its_worker_leaves_the_other_serving(
    tmp_path: Path, minilm_path: Path, page
):  # noqa: ANN001
    logs = tmp_path / "logs"
    logs.mkdir()
    spawned: list[subprocess.Popen] = []
    with namespaces(2) as (ns_a, ns_b):
        postgres_runner = run_postgres(listen=("127.0.0.1", ns_a.gateway, ns_b.gateway))
        postgres = next(postgres_runner)
        redis_dir = tmp_path / "redis"
        redis_dir.mkdir()
        redis = RedisServer(port=free_port(), data_dir=redis_dir, bind=("127.0.0.1", ns_a.gateway, ns_b.gateway))
        redis.start()
        triton = free_ports(30)
        base_env = {
            **os.environ,
            "GANTRY_HEARTBEAT_INTERVAL": "1",
            "GANTRY_TRITON_PORT_RANGE": f"{triton}-{triton + 29}",  # the same ports on both hosts
            "PYTHONUNBUFFERED": "1",
        }
        control_env = {**base_env, "DATABASE_URL": postgres.url, "REDIS_URL": redis.url}

        def host_env(name: str, ns: Namespace) -> dict[str, str]:
            return {
                **base_env,
                "DATABASE_URL": postgres.url.replace("127.0.0.1", ns.gateway),
                "REDIS_URL": redis.url.replace("127.0.0.1", ns.gateway),
                "GANTRY_HOST_NAME": name,
                "GANTRY_HOST_ADDRESS": ns.address,
                "GANTRY_DATA_DIR": str(tmp_path / name),
            }

        hosts = {"host-a": ns_a, "host-b": ns_b}

        def start_worker(name: str) -> subprocess.Popen:
            argv = ["ip", "netns", "exec", hosts[name].name, *host_worker_argv(sys.executable, name)]
            worker = _spawn(argv, host_env(name, hosts[name]), logs / f"worker-{name}.log")
            spawned.append(worker)
            return worker

        try:
            token = bootstrap(control_env)
            web_port, live_port = free_port(), free_port()
            control_env["GANTRY_LIVE_PORT"] = str(live_port)
            web_argv_ = web_argv(sys.executable, bind="127.0.0.1", port=web_port, workers=1)
            spawned.append(_spawn(web_argv_, control_env, logs / "web.log"))
            live = live_argv(sys.executable, bind="127.0.0.1", port=live_port)
            spawned.append(_spawn(live, control_env, logs / "live.log"))
            beat = [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "--beat", "-Q", "control",
                    "-c", "1", "-s", str(tmp_path / "beat-schedule")]  # fmt: skip
            spawned.append(_spawn(beat, control_env, logs / "beat.log"))
            workers = {name: start_worker(name) for name in hosts}

            base = f"http://127.0.0.1:{web_port}"
            http = requests.Session()
            http.headers["Authorization"] = f"Bearer {token}"

            def get(path: str) -> dict:
                return http.get(f"{base}{path}", timeout=10).json()

            def inspection(model: str) -> str:
                return next(m["inspection"] for m in get("/api/models/?limit=500")["results"] if m["name"] == model)

            def host_row(name: str) -> dict:
                return next((h for h in get("/api/hosts/")["results"] if h["name"] == name), {})

            wait_for(lambda: healthz_answers(base), 30, "the web server")
            wait_for(lambda: all(host_row(n).get("is_online") for n in hosts), 60, "both hosts' first beats")
            assert {host_row(n)["address"] for n in hosts} == {ns_a.address, ns_b.address}

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

            workers["host-a"] = start_worker("host-a")
            wait_for(lambda: shown("host-a") == "ready", 60, "host A's deployment to converge")
            expect(badge("host-a")).to_have_text("ready", timeout=10_000)
            expect(page.locator("[data-host='host-a'] [data-status]")).to_have_text("online")
            timeline = [e["kind"] for e in get(f"/api/deployments/{deployment['host-a']}/events/")["results"]]
            assert "deployment.adopted" in timeline and "host.online" in kinds()
            for name in hosts:
                http.post(f"{base}/api/deployments/{deployment[name]}/stop/", timeout=30)
            for name in hosts:
                wait_for(lambda n=name: shown(n) == "stopped", 60, f"the deployment on {name} to stop")
            for name in hosts:
                assert process.servers_under(tmp_path / name) == []
        finally:
            for child in reversed(spawned):
                stop_process(child)
            clean_up([tmp_path / name for name in hosts], logs)
            redis.stop()
            next(postgres_runner, None)  # stops and removes it
