"""One address in front of the three servers, as production runs them: nginx
with the configuration `gantry proxy-config` writes, the pages server (gunicorn
sync workers, WSGI), the web server (gunicorn + uvicorn, ASGI) and the live server
(daphne). Each request is followed to the server whose access log has it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from django.db import connection
from websockets.sync.client import connect

from access.services import token_create
from controlplane.proxy import nginx_config
from controlplane.serving import live_argv, pages_argv, web_argv
from core.events import DASHBOARD_GROUP, publish
from gateway.services import key_create
from tests.integration.conftest import (
    _spawn,
    free_port,
    healthz_answers,
    spawned_database_url,
    stop_process,
    wait_for,
)

NGINX = shutil.which("nginx") or shutil.which("/usr/sbin/nginx")  # sbin is not on every PATH
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (make test installs it)")
METRICS_TOKEN = "proxy-test-metrics-token"
PAGES_APPLICATION = "gantry-proxy-test-pages"


@dataclass
class Front:
    url: str
    logs: Path
    token: str

    def log(self, server: str) -> str:
        return (self.logs / f"{server}.log").read_text(errors="replace")


@pytest.fixture
def front(transactional_db, tmp_path: Path, operator) -> Iterator[Front]:  # noqa: ANN001
    database_url = spawned_database_url()
    ports = {name: free_port() for name in ("proxy", "pages", "web", "live")}
    env = {**os.environ, "DATABASE_URL": database_url, "GANTRY_METRICS_TOKEN": METRICS_TOKEN, "GANTRY_LIVE_PORT": ""}
    logs = tmp_path / "logs"
    (logs / "nginx").mkdir(parents=True)
    config = logs / "nginx.conf"
    config.write_text(
        nginx_config(
            listen=f"127.0.0.1:{ports['proxy']}",
            **{name: f"127.0.0.1:{ports[name]}" for name in ("pages", "web", "live")},
            run_dir=logs / "nginx",
        )
    )
    check = subprocess.run([NGINX, "-t", "-c", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    # The pages server's sessions are told apart by their application_name.
    pages_env = {**env, "DATABASE_URL": f"{database_url}?application_name={PAGES_APPLICATION}"}
    spawned = [
        _spawn(
            pages_argv(sys.executable, bind="127.0.0.1", port=ports["pages"], workers=1), pages_env, logs / "pages.log"
        ),
        _spawn(web_argv(sys.executable, bind="127.0.0.1", port=ports["web"], workers=1), env, logs / "web.log"),
        _spawn(live_argv(sys.executable, bind="127.0.0.1", port=ports["live"]), env, logs / "live.log"),
        _spawn([NGINX, "-c", str(config)], env, logs / "nginx.log"),
    ]
    url = f"http://127.0.0.1:{ports['proxy']}"
    try:
        for name in ("pages", "web"):
            wait_for(lambda name=name: healthz_answers(f"http://127.0.0.1:{ports[name]}"), 30, f"the {name} server")
        wait_for(lambda: healthz_answers(url), 10, "nginx")
        yield Front(url=url, logs=logs, token=token_create(user=operator, name="proxy").secret)
    finally:
        for process in reversed(spawned):
            stop_process(process)


def _served_by(front: Front, request_line: str) -> list[str]:
    """The servers whose access log has ``request_line``, once one has it (a web
    server's line is written by a thread of its own, after the answer)."""
    return wait_for(
        lambda: [server for server in ("pages", "web") if request_line in front.log(server)], 10, request_line
    )


def _pages_sessions() -> set[int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", [PAGES_APPLICATION])
        return {pid for (pid,) in cursor.fetchall()}


def test_pages_api_and_admin_go_to_the_pages_server_and_keep_their_connection(front: Front):
    http = requests.Session()
    http.headers["Authorization"] = f"Bearer {front.token}"
    for _ in range(10):
        assert http.get(f"{front.url}/api/hosts/", timeout=10).status_code == 200
    # Its one process's connection, open while it is idle (a connection closed at a
    # request's end may stay listed a moment, until its backend has exited).
    kept = wait_for(lambda: len(sessions := _pages_sessions()) == 1 and sessions, 10, "one pages session")
    for _ in range(20):
        assert http.get(f"{front.url}/api/hosts/", timeout=10).status_code == 200
    assert _pages_sessions() == kept  # the same one: none opened per request
    assert requests.get(f"{front.url}/", timeout=10, allow_redirects=False).status_code == 302  # to the login page
    assert requests.get(f"{front.url}/admin/login/", timeout=10).status_code == 200
    assert _served_by(front, '"GET /api/hosts/ HTTP/1.1"') == ["pages"]
    assert _served_by(front, '"GET / HTTP/1.1"') == ["pages"]
    assert _served_by(front, '"GET /admin/login/ HTTP/1.1"') == ["pages"]


def test_the_gateway_and_metrics_go_to_the_web_server(front: Front, operator):  # noqa: ANN001
    key = key_create(name="proxy", user=operator, all_aliases=True).secret
    models = requests.get(f"{front.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert models.status_code == 200, models.text
    assert models.json() == {"object": "list", "data": []}
    scraped = requests.get(f"{front.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10)
    assert scraped.status_code == 200 and "gantry_deployments" in scraped.text
    # A streamed generate request for a deployment that does not exist: refused by the web server.
    generate = requests.post(
        f"{front.url}/api/deployments/999999/generate/", json={"prompt": "hi", "stream": True},
        headers={"Authorization": f"Bearer {front.token}"}, timeout=10,
    )  # fmt: skip
    assert generate.status_code == 404, generate.text
    assert _served_by(front, '"GET /v1/models HTTP/1.1"') == ["web"]
    assert _served_by(front, '"GET /metrics HTTP/1.1"') == ["web"]
    assert _served_by(front, '"POST /api/deployments/999999/generate/ HTTP/1.1"') == ["web"]


def test_websockets_go_to_the_live_server_through_the_same_address(front: Front):
    headers = {"Authorization": f"Bearer {front.token}", "Origin": front.url}
    with connect(f"{front.url.replace('http', 'ws', 1)}/ws/dashboard/", additional_headers=headers) as socket:
        publish(DASHBOARD_GROUP, {"type": "proxy-test", "n": 1})
        while (message := json.loads(socket.recv(timeout=10))).get("type") != "proxy-test":
            pass
    assert message["n"] == 1


def test_the_demos_one_port_serves_pages_the_gateway_and_websockets(transactional_db, tmp_path: Path, operator):  # noqa: ANN001
    """Without a proxy (make demo), the web server with websockets on answers every door."""
    env = {**os.environ, "GANTRY_LIVE_PORT": "", "DATABASE_URL": spawned_database_url()}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    web = _spawn(web_argv(sys.executable, bind="127.0.0.1", port=port, workers=1, websockets=True), env,
                 tmp_path / "web.log")  # fmt: skip
    try:
        wait_for(lambda: healthz_answers(url), 30, "the web server")
        token = token_create(user=operator, name="demo").secret
        assert requests.get(f"{url}/api/hosts/", headers={"Authorization": f"Bearer {token}"}, timeout=10).ok
        key = key_create(name="demo", user=operator, all_aliases=True).secret
        assert requests.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).ok
        headers = {"Authorization": f"Bearer {token}", "Origin": url}
        with connect(f"ws://127.0.0.1:{port}/ws/dashboard/", additional_headers=headers) as socket:
            publish(DASHBOARD_GROUP, {"type": "demo-test", "n": 2})
            while (message := json.loads(socket.recv(timeout=10))).get("type") != "demo-test":
                pass
        assert message["n"] == 2
    finally:
        stop_process(web)
