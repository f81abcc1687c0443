"""A GPU host joins in one step, for real: a host in a network namespace of its
own (PostgreSQL and Redis reached over a veth pair, by password) runs
`gantry join URL TOKEN` with nothing configured, gets a database role and a
Redis user of its own and its channel's certificate, and its worker serves a
deployment with them through the channel. Revoking them cuts the host off;
the control plane's own passwords never reach it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
import requests

from controlplane.serving import web_argv
from tests.integration.conftest import (
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
from workers.hostjoin import read_env_file

pytestmark = [pytest.mark.integration]

# What a fresh GPU host has before it joins: no database, Redis or secret key.
BARE = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LD_LIBRARY_PATH", "TMPDIR")}


def test_a_host_joins_with_one_command_serves_with_its_own_credentials_and_is_cut_off_when_revoked(
    tmp_path: Path, minilm_path: Path
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    spawned: list[subprocess.Popen] = []
    with namespaces(1) as (ns,):
        postgres_runner = run_postgres(listen=("127.0.0.1", ns.gateway), namespace_auth="scram-sha-256")
        postgres = next(postgres_runner)
        redis_dir = tmp_path / "redis"
        redis_dir.mkdir()
        redis = RedisServer(
            port=free_port(), data_dir=redis_dir, bind=("127.0.0.1", ns.gateway), password="control-plane-only"
        )
        redis.start()
        control_env = {
            **os.environ,
            "DATABASE_URL": postgres.url,
            "REDIS_URL": redis.url,
            "GANTRY_JOIN_DATABASE_URL": postgres.url.replace("127.0.0.1", ns.gateway),
            "GANTRY_JOIN_REDIS_URL": redis.url.replace("127.0.0.1", ns.gateway),
            "GANTRY_HEARTBEAT_INTERVAL": "1",
            "GANTRY_DATA_DIR": str(tmp_path / "control"),
            "ALLOWED_HOSTS": ns.gateway,
            "PYTHONUNBUFFERED": "1",
        }
        host_dir = tmp_path / "gpu-j"
        try:
            token = bootstrap(control_env)
            web_port = free_port()
            base = f"http://{ns.gateway}:{web_port}"  # where the host reaches the web server
            spawned.append(_spawn(web_argv(sys.executable, bind=ns.gateway, port=web_port, workers=1), control_env,
                                  logs / "web.log"))  # fmt: skip
            beat = [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "--beat", "-Q", "control",
                    "-c", "1", "-s", str(tmp_path / "beat-schedule")]  # fmt: skip
            spawned.append(_spawn(beat, control_env, logs / "beat.log"))
            wait_for(lambda: healthz_answers(base), 30, "the web server")

            # The admin makes a one-time token; the command to run comes with it.
            made = subprocess.run(
                [sys.executable, "-m", "controlplane.cli", "join-token", "--host", "gpu-j", "--url", base],
                env=control_env, capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            command = made.strip().splitlines()[-1].split()
            assert command[:2] == ["gantry", "join"] and command[2] == base and command[-2:] == ["--name", "gpu-j"]

            def join(*argv: str) -> subprocess.CompletedProcess:
                return subprocess.run(
                    ["ip", "netns", "exec", ns.name, sys.executable, "-m", "controlplane.cli", *argv],
                    env={**BARE, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=300,
                )  # fmt: skip

            refused = join(*command[1:], "--no-start")  # the token and passwords would cross in clear
            assert refused.returncode == 2 and "plain HTTP" in refused.stderr and "--allow-http" in refused.stderr
            options = ["--address", ns.address, "--data-dir", str(host_dir), "--no-start", "--allow-http"]
            options += ["--model-roots", str(minilm_path.parent)]
            options += ["--config-dir", str(tmp_path / "etc"), "--unit-dir", str(tmp_path / "units")]
            joined = join(*command[1:], *options)
            assert joined.returncode == 0, joined.stdout + joined.stderr
            assert "ok      database" in joined.stdout and "ok      Redis" in joined.stdout, joined.stdout

            env_file = tmp_path / "etc" / "gantry.env"
            assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
            host_settings = read_env_file(env_file)
            assert host_settings["GANTRY_HOST_NAME"] == "gpu-j" and host_settings["GANTRY_HOST_ADDRESS"] == ns.address
            assert "postgres@" not in host_settings["DATABASE_URL"] and ns.gateway in host_settings["DATABASE_URL"]
            assert "control-plane-only" not in env_file.read_text()  # Redis's own password never leaves
            assert host_settings["SECRET_KEY"] != control_env.get("SECRET_KEY")
            unit = (tmp_path / "units" / "gantry-worker.service").read_text()
            assert f"EnvironmentFile={env_file}" in unit and "Restart=always" in unit

            again = join(*command[1:], *options)  # the token was for one join
            assert again.returncode == 2 and "already used, by host gpu-j" in again.stderr

            # By password: the right one works from the host, a wrong one does not.
            password = host_settings["DATABASE_URL"].split("//")[1].split("@")[0].split(":")[1]
            with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
                psycopg.connect(host_settings["DATABASE_URL"].replace(password, "guessed"))

            # The worker starts as systemd would start it: the env file, nothing else.
            triton = free_ports(3)
            worker_env = {**BARE, **host_settings, "GANTRY_TRITON_PORT_RANGE": f"{triton}-{triton + 2}"}
            worker_argv = ["ip", "netns", "exec", ns.name, sys.executable, "-m", "controlplane.cli", "worker"]
            worker = _spawn(worker_argv, worker_env, logs / "worker.log")
            spawned.append(worker)

            http = requests.Session()
            http.headers["Authorization"] = f"Bearer {token}"

            def get(path: str) -> dict:
                return http.get(f"{base}{path}", timeout=10).json()

            def host_row() -> dict:
                return next((h for h in get("/api/hosts/")["results"] if h["name"] == "gpu-j"), {})

            wait_for(lambda: host_row().get("is_online"), 60, "the joined host's first beat")
            assert host_row()["address"] == ns.address
            body = {"name": "minilm-j", "kind": "embedding", "path": str(minilm_path), "host": "gpu-j"}
            assert http.post(f"{base}/api/models/", json=body, timeout=30).status_code == 201

            def inspection() -> str:
                return next(m["inspection"] for m in get("/api/models/")["results"] if m["name"] == "minilm-j")

            wait_for(lambda: inspection() == "ready", 60, "the inspection on the joined host")
            body = {"name": "on-j", "host": "gpu-j", "models": [{"model": "minilm-j"}]}
            deployment = http.post(f"{base}/api/deployments/", json=body, timeout=30).json()["id"]
            assert http.post(f"{base}/api/deployments/{deployment}/start/", timeout=30).status_code == 202
            shown = lambda: get(f"/api/deployments/{deployment}/")["shown_status"]  # noqa: E731
            wait_for(lambda: shown() == "ready", 240, "the deployment on the joined host")
            answer = http.post(f"{base}/api/deployments/{deployment}/embed/", json={"texts": ["joined"]}, timeout=30)
            assert answer.status_code == 200 and len(answer.json()["embeddings"][0]) == 384, answer.text

            # The channel's key, certificate and trust came with the join, private to the host.
            assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in (host_dir / "channel").glob("*.pem")} == {
                "key.pem": 0o600, "cert.pem": 0o600, "trust.pem": 0o600}  # fmt: skip
            assert "signed (joined)" in " ".join(
                e["message"] for e in get("/api/events/?host=gpu-j&kind=host.certificate")["results"]
            )

            # Revoked (its credentials and its certificate): the worker is cut off from the
            # database, Redis and the web tier, and the host goes offline.
            assert http.post(f"{base}/api/hosts/gpu-j/revoke/", timeout=30).json() == {"revoked": 2}
            gone = http.post(f"{base}/api/deployments/{deployment}/embed/", json={"texts": ["joined"]}, timeout=30)
            assert gone.status_code == 503 and "none of its replicas can be reached" in gone.text, gone.text
            with pytest.raises(psycopg.OperationalError):
                psycopg.connect(host_settings["DATABASE_URL"])
            kinds = lambda: [e["kind"] for e in get("/api/events/?host=gpu-j&limit=100")["results"]]  # noqa: E731
            wait_for(lambda: "host.offline" in kinds(), 60, "the revoked host to go offline")
            assert {"host.joined", "host.revoked"} <= set(kinds())
        finally:
            for process_ in reversed(spawned):
                stop_process(process_)
            clean_up([host_dir], logs)
            redis.stop()
            next(postgres_runner, None)
