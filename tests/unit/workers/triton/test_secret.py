"""The admin secret reaches a real tritonserver (the pytriton wheel's) through
the library Gantry compiles, never through its command line, and the server
refuses to start when the secret cannot reach it."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest
import requests

from tests.integration.conftest import free_ports, wait_for
from workers import processes
from workers.runtimes import process
from workers.triton import secret


def test_the_rule_file_is_the_agents_alone_even_over_a_looser_one(tmp_path: Path):
    (tmp_path / secret.RULE_FILE).write_text("old")
    (tmp_path / secret.RULE_FILE).chmod(0o644)
    path = secret.write_rule(tmp_path, "s3cret")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == "model-repository,logging:gantry-admin-key=s3cret\n"
    assert secret.prepare("", tmp_path, tmp_path) is None  # no secret, no restriction, nothing written


def test_the_library_is_compiled_once_per_source(tmp_path: Path):
    built = secret.library(tmp_path)
    assert built.name.startswith(secret.LIBRARY_PREFIX) and built.suffix == ".so"
    modified = built.stat().st_mtime_ns
    assert secret.library(tmp_path) == built and built.stat().st_mtime_ns == modified


def test_without_a_compiler_a_copy_built_beside_the_source_serves_else_the_error_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    built = secret.library(tmp_path / "built")
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(Exception, match=r"no C compiler \(cc\) on this host.*apt-get install gcc"):
        secret.library(tmp_path / "elsewhere")
    # As Gantry's image has it: the library built at image time, beside the source.
    source = tmp_path / "image" / secret.SOURCE.name
    source.parent.mkdir()
    source.write_bytes(secret.SOURCE.read_bytes())
    (source.parent / built.name).write_bytes(built.read_bytes())
    monkeypatch.setattr(secret, "SOURCE", source)
    assert secret.library(tmp_path / "elsewhere") == source.parent / built.name


def _start(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen, int, Path]:
    (tmp_path / "repository").mkdir(exist_ok=True)
    port = free_ports(3)
    log_path = tmp_path / "tritonserver.log"
    argv = [
        str(process._triton_dist() / "bin" / "tritonserver"),
        f"--model-repository={tmp_path / 'repository'}",
        "--model-control-mode=explicit",
        f"--http-port={port}",
        f"--grpc-port={port + 1}",
        f"--metrics-port={port + 2}",
        *secret.restricted_api_args("s3cret-value"),
    ]
    with open(log_path, "wb") as log_file:
        server = processes.start_group(argv, stdout=log_file, env={**process.server_environment(), **env})
    return server, port, log_path


def _live(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/v2/health/live", timeout=1).ok
    except requests.ConnectionError:
        return False


def test_the_server_takes_the_secret_from_the_file_and_shows_only_the_token(tmp_path: Path):
    files = secret.prepare("s3cret-value", tmp_path, tmp_path)
    server, port, _ = _start(tmp_path, files.environment())
    try:
        index = f"http://127.0.0.1:{port}/v2/repository/index"
        wait_for(lambda: _live(port), 30, "tritonserver to answer")
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert b"s3cret-value" not in cmdline and secret.TOKEN.encode() in cmdline
        assert requests.post(index, timeout=5).status_code == 403
        assert requests.post(index, headers={"gantry-admin-key": secret.TOKEN}, timeout=5).status_code == 403
        assert requests.post(index, headers={"gantry-admin-key": "s3cret-value"}, timeout=5).status_code == 200
    finally:
        processes.terminate_group(server.pid, grace_s=10)
        server.wait(timeout=10)


def test_without_the_library_or_the_file_the_server_does_not_start(tmp_path: Path):
    server, _, log_path = _start(tmp_path, {})  # no LD_PRELOAD: the token is a malformed rule
    assert server.wait(timeout=30) != 0
    assert "--http-restricted-api option format is" in log_path.read_text()

    files = secret.prepare("s3cret-value", tmp_path, tmp_path)
    files.rule.unlink()
    server, _, log_path = _start(tmp_path, files.environment())
    assert server.wait(timeout=30) == 78
    assert f"gantry: cannot open the admin secret file {files.rule}" in log_path.read_text()
