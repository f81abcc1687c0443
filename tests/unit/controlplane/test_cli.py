"""The `gantry` command, run as a user runs it: the console script pip installs,
in a fresh process with only the environment it is given."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from common.version import gantry_version
from tests.integration.conftest import free_ports, wait_for

GANTRY = Path(sys.executable).with_name("gantry")
ROOT = Path(__file__).resolve().parents[3]


def _run(env: dict[str, str], *argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    keep = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    return subprocess.run(
        [str(GANTRY), *argv], env={**keep, **env}, capture_output=True, text=True, timeout=timeout_s, cwd="/"
    )


def test_pip_install_gives_a_gantry_command_that_says_its_version():
    assert GANTRY.exists(), "pip install . did not install the gantry console script"
    shown = _run({}, "--version")
    assert shown.returncode == 0 and shown.stdout.strip() == f"gantry {gantry_version()}"
    assert f'version = "{gantry_version()}"' in (ROOT / "pyproject.toml").read_text()


def test_the_token_recipe_works_beside_a_demos_data_folder_with_nothing_exported(tmp_path: Path):
    """What the README says after `gantry demo`: migrate, an admin, a token, with
    only GANTRY_DATA_DIR pointing where the demo keeps its secret key."""
    env = {"GANTRY_DATA_DIR": str(tmp_path)}
    refused = _run(env, "token", "admin")
    assert refused.returncode != 0 and "SECRET_KEY is required" in refused.stderr
    (tmp_path / "secret_key").write_text("a-local-secret-key-for-this-test-only\n")
    assert _run(env, "migrate").returncode == 0
    made = _run({**env, "GANTRY_ADMIN_PASSWORD": "pw-for-the-test"}, "createadmin")
    assert made.stdout.strip() == "Log in as 'admin' with the password from GANTRY_ADMIN_PASSWORD."
    token = _run(env, "token", "admin", "--name", "curl")
    assert token.returncode == 0, token.stderr
    assert token.stdout.strip().startswith("gt-")


def test_check_names_what_the_host_lacks_with_each_fix(tmp_path: Path):
    env = {
        "SECRET_KEY": "x",
        "GANTRY_DATA_DIR": str(tmp_path),
        "DATABASE_URL": "postgres://nobody@127.0.0.1:1/none",
        "REDIS_URL": "redis://127.0.0.1:1/0",
        "GANTRY_ALLOWED_IMAGES": "gantry/no-such-image:1",
        "GANTRY_AIPERF": str(tmp_path / "no-aiperf"),
    }
    report = _run(env, "check")
    assert report.returncode == 1
    lines = report.stdout.splitlines()
    assert any(line.startswith("MISSING database") for line in lines), report.stdout
    assert any(line.startswith("MISSING Redis") for line in lines)
    assert any(line.startswith("warn    AIPerf") for line in lines)
    assert "fix: set DATABASE_URL to the control plane's PostgreSQL" in report.stdout
    assert "fix: scripts/ensure-aiperf.sh" in report.stdout


def test_check_install_says_why_an_image_could_not_be_pulled(tmp_path: Path):
    env = {"SECRET_KEY": "x", "GANTRY_DATA_DIR": str(tmp_path), "GANTRY_ALLOWED_IMAGES": "gantry/no-such-image:1"}
    report = _run(env, "check", "--install")
    assert "install " in report.stdout and "gantry/no-such-image:1" in report.stdout, report.stdout


def test_join_refuses_plain_http_across_the_network_unless_allowed(tmp_path: Path):
    refused = _run({}, "join", "http://10.0.0.5:8000", "gj-x", "--config-dir", str(tmp_path), "--no-start")
    assert refused.returncode == 2 and "plain HTTP" in refused.stderr
    assert not (tmp_path / "gantry.env").exists()
    allowed = _run({}, "join", "http://127.0.0.1:1", "gj-x", "--config-dir", str(tmp_path), "--no-start")
    assert "plain HTTP" not in allowed.stderr  # this machine itself: refused only because nothing answers


def test_join_with_nothing_configured_says_why_it_could_not_join(tmp_path: Path):
    (port,) = [free_ports(1)]
    unreachable = _run({}, "join", f"http://127.0.0.1:{port}", "gj-x", "--config-dir", str(tmp_path), "--no-start")
    assert unreachable.returncode == 2
    assert f"cannot reach the control plane at http://127.0.0.1:{port}" in unreachable.stderr
    assert not (tmp_path / "gantry.env").exists()  # nothing half-written


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="make test installs redis-server")
def test_the_demo_refuses_a_redis_it_did_not_start(tmp_path: Path):
    """Nothing in REDIS_URL: the demo's own Redis is on its web port + 2, and one
    that answers there already (whoever's it is) is refused, not shared."""
    port = free_ports(3)
    foreign = subprocess.Popen(
        ["redis-server", "--port", str(port + 2), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        client = redis.Redis(port=port + 2)
        wait_for(lambda: _pings(client), 10, "the other Redis")
        refused = _run({"GANTRY_DATA_DIR": str(tmp_path)}, "demo", "--port", str(port), timeout_s=60)
        assert refused.returncode != 0
        assert f"a Redis this demo did not start answers at 127.0.0.1:{port + 2} already" in refused.stderr
        assert (tmp_path / "secret_key").stat().st_mode & 0o077 == 0  # the demo's key, this user's only
    finally:
        foreign.terminate()
        foreign.wait()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.mark.parametrize("what", ["worker", "web", "live", "beat"])
def test_the_systemd_unit_restarts_gantry_always_and_systemd_accepts_it(tmp_path: Path, what: str):
    made = _run({}, "unit", what, "--env-file", "/etc/gantry/gantry.env", "--user", "root", "--write", str(tmp_path))
    assert made.returncode == 0, made.stderr
    unit = tmp_path / f"gantry-{what}.service"
    assert f"systemctl enable --now gantry-{what}" in made.stdout
    lines = unit.read_text().splitlines()
    assert f"ExecStart={GANTRY} {what}" in lines
    assert {"Restart=always", "RestartSec=2", "EnvironmentFile=/etc/gantry/gantry.env", "KillMode=mixed"} <= set(lines)
    analyze = shutil.which("systemd-analyze")
    if analyze:  # systemd's own reading of it, where systemd is installed
        (tmp_path / "gantry.env").write_text("GANTRY_HOST_NAME=gpu-01\n")
        unit.write_text(unit.read_text().replace("/etc/gantry/gantry.env", str(tmp_path / "gantry.env")))
        verified = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
        assert verified.returncode == 0, verified.stderr


def test_check_warns_when_other_users_can_read_command_lines(tmp_path: Path):
    from workers.hostcheck import OK, WARN, _hidden_processes

    mounts = tmp_path / "mounts"
    mounts.write_text("sysfs /sys sysfs rw 0 0\nproc /proc proc rw,nosuid,nodev,noexec,relatime 0 0\n")
    open_proc = _hidden_processes(mounts)
    assert open_proc.state == WARN and "admin secret" in open_proc.detail and "hidepid=invisible" in open_proc.fix
    mounts.write_text("proc /proc proc rw,nosuid,nodev,noexec,relatime,hidepid=invisible 0 0\n")
    assert _hidden_processes(mounts).state == OK


def test_the_demo_takes_its_own_options():
    from controlplane.cli import parser

    args = parser().parse_args(["demo", "--port", "9000", "--no-stack", "--bind", "0.0.0.0"])
    assert (args.port, args.no_stack, args.bind) == (9000, True, "0.0.0.0")
