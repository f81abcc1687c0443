"""A GPU host joins in one step, for real: a host in a network namespace of its
own (PostgreSQL and Redis reached over a veth pair, by password) runs
`gantry join URL TOKEN` with nothing configured, gets a database role and a
Redis user of its own and its channel's certificate, and its worker serves a
deployment with them through the channel. Revoking them cuts the host off;
the control plane's own passwords never reach it.

The checkpoint it serves carries its own code (auto_map), written here as an
attacker would: from inside Triton it tries to read the worker's environment,
the settings file, the channel's key and the Docker socket, to write into the
checkpoint, and to sign in to PostgreSQL and Redis with whatever it found. It
runs as the model user `gantry join` made, and every attempt is refused."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
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
MODEL_USER = "gantry-model"  # gantry join's default, made by it when missing

# The checkpoint's own code: runs when Triton loads the model, before the model
# itself, and writes what each attempt met to probe.json in its own folder.
PROBE = """
import json, os, pathlib, pwd, socket

import psycopg
import redis
from transformers import BertModel

TARGETS = json.loads({targets!r})
met = {{"user": pwd.getpwuid(os.getuid()).pw_name, "groups": os.getgroups()}}


def attempt(name, action):
    try:
        met[name] = ["done", str(action())[:200]]
    except Exception as exc:
        met[name] = [type(exc).__name__, str(exc)[:200]]


def environ_secrets():
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            data = (entry / "environ").read_bytes()
        except OSError:
            continue
        found += [v.decode() for v in data.split(b"\\0") if v.startswith((b"DATABASE_URL=", b"REDIS_URL="))]
    return found


found = []
attempt("worker_environ", lambda: (pathlib.Path("/proc") / str(TARGETS["worker_pid"]) / "environ").read_bytes())
met["secrets_in_any_environ"] = environ_secrets()
attempt("env_file", lambda: pathlib.Path(TARGETS["env_file"]).read_text())
attempt("channel_key", lambda: pathlib.Path(TARGETS["channel_key"]).read_text())
attempt("docker_socket", lambda: socket.socket(socket.AF_UNIX).connect(TARGETS["docker_socket"]))
attempt("checkpoint_write", lambda: (pathlib.Path(TARGETS["checkpoint"]) / "planted.py").write_text("x = 1"))
attempt("own_folder_write", lambda: (pathlib.Path(os.environ["HOME"]) / "mine.txt").write_text("mine"))
for value in met["secrets_in_any_environ"]:
    found.append(value.split("=", 1)[1])
for key in ("env_file", "channel_key"):
    if met[key][0] == "done":
        found.append(met[key][1])
database = TARGETS["database"]
attempt("postgres", lambda: psycopg.connect(next((f for f in found if f.startswith("postgres")), database),
                                            connect_timeout=5).close())
attempt("redis", lambda: redis.Redis.from_url(next((f for f in found if f.startswith("redis")), TARGETS["redis"]),
                                              socket_timeout=5).ping())
(pathlib.Path(os.environ["HOME"]) / "probe.json").write_text(json.dumps(met))


class ProbeModel(BertModel):
    pass
"""


def remote_code_checkpoint(source: Path, target: Path, targets: dict) -> Path:
    """A copy of ``source`` whose model class is its own code (``PROBE``)."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_probe.ProbeModel"}
    (target / "config.json").write_text(json.dumps(config))
    (target / "modeling_probe.py").write_text(PROBE.format(targets=json.dumps(targets)))
    return target


def test_a_host_joins_with_one_command_serves_with_its_own_credentials_and_is_cut_off_when_revoked(
    tmp_path: Path, minilm_path: Path, python_open_to_other_users: None
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
        # Not under tmp_path (private to this user): the model user reads the checkpoint and repository.
        shared = Path(tempfile.mkdtemp(prefix="gantry-test-join-"))
        shared.chmod(0o755)
        host_dir = shared / "gpu-j"
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
            options += ["--model-roots", f"{minilm_path.parent},{shared}"]
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
            assert host_settings["GANTRY_MODEL_USER"] == MODEL_USER and pwd.getpwnam(MODEL_USER).pw_uid != 0
            assert "AmbientCapabilities=CAP_CHOWN CAP_KILL CAP_SETGID CAP_SETUID" in unit  # to switch to it

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
            checkpoint = remote_code_checkpoint(minilm_path, shared / "probe-minilm", {
                "worker_pid": worker.pid, "env_file": str(env_file),
                "channel_key": str(host_dir / "channel" / "key.pem"),
                "docker_socket": "/var/run/docker.sock", "checkpoint": str(shared / "probe-minilm"),
                "database": f"postgres://postgres@{ns.gateway}:{postgres.port}/gantry",
                "redis": f"redis://{ns.gateway}:{redis.port}/0",
            })  # fmt: skip

            def inspection(name: str) -> dict:
                return next(m for m in get("/api/models/")["results"] if m["name"] == name)

            # Its own code is not run unasked: the host's inspection refuses it without trust_remote_code.
            body = {"name": "untrusted-j", "kind": "embedding", "path": str(checkpoint), "host": "gpu-j"}
            assert http.post(f"{base}/api/models/", json=body, timeout=30).status_code == 201
            refused = wait_for(lambda: (m := inspection("untrusted-j"))["inspection"] == "failed" and m, 60,
                               "the untrusted checkpoint's inspection")  # fmt: skip
            assert "trust_remote_code" in refused["inspection_message"], refused
            body = {**body, "name": "minilm-j", "trust_remote_code": True}
            assert http.post(f"{base}/api/models/", json=body, timeout=30).status_code == 201
            wait_for(lambda: inspection("minilm-j")["inspection"] == "ready", 60, "the inspection on the joined host")
            body = {"name": "on-j", "host": "gpu-j", "models": [{"model": "minilm-j"}]}
            deployment = http.post(f"{base}/api/deployments/", json=body, timeout=30).json()["id"]
            assert http.post(f"{base}/api/deployments/{deployment}/start/", timeout=30).status_code == 202
            shown = lambda: get(f"/api/deployments/{deployment}/")["shown_status"]  # noqa: E731
            wait_for(lambda: shown() == "ready", 240, "the deployment on the joined host")
            answer = http.post(f"{base}/api/deployments/{deployment}/embed/", json={"texts": ["joined"]}, timeout=30)
            assert answer.status_code == 200 and len(answer.json()["embeddings"][0]) == 384, answer.text

            # The checkpoint's own code ran as the model user, and met a refusal at every turn.
            (probe,) = host_dir.glob("deployments/*/r1/model-home/probe.json")
            met = json.loads(probe.read_text())
            assert met["user"] == MODEL_USER and met["groups"] in ([], [pwd.getpwnam(MODEL_USER).pw_gid]), met
            for attempt in ("worker_environ", "env_file", "channel_key", "docker_socket", "checkpoint_write"):
                assert met[attempt][0] == "PermissionError", (attempt, met[attempt])
            assert met["secrets_in_any_environ"] == [], met
            assert met["own_folder_write"][0] == "done", met
            assert met["postgres"][0] == "OperationalError" and "password" in met["postgres"][1], met["postgres"]
            assert met["redis"][0] == "AuthenticationError", met["redis"]

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
            shutil.rmtree(shared, ignore_errors=True)
            redis.stop()
            next(postgres_runner, None)
