"""The admin secret reaches a real tritonserver (the pytriton wheel's) through
the library Gantry compiles, never through its command line, and the server
refuses to start when the secret cannot reach it."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest
import requests

from tests import factories
from tests.integration.conftest import free_ports, wait_for
from triton_server import secret
from triton_server.server import LaunchSpec
from workers import processes
from workers.runtimes import process


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


def _spec(tmp_path: Path) -> LaunchSpec:
    (tmp_path / "repository").mkdir(exist_ok=True)
    port = free_ports(3)
    return factories.launch_spec(
        tmp_path, models=[], http_port=port, grpc_port=port + 1, metrics_port=port + 2, admin_secret="s3cret-value"
    )


def _run(spec: LaunchSpec, env: dict[str, str]) -> subprocess.Popen:
    """The process runtime's own command line for ``spec``, under ``env``."""
    backends = process.prepare_backends(spec.repository.parent)
    with open(spec.log_path, "wb") as log_file:
        return processes.start_group(process.command_line(spec, backends), stdout=log_file, env=env)


def _live(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/v2/health/live", timeout=1).ok
    except requests.ConnectionError:
        return False


def test_the_server_takes_the_secret_from_the_file_and_shows_only_the_token(tmp_path: Path):
    spec = _spec(tmp_path)
    handle = process.start(spec, data_dir=tmp_path)  # as the process runtime starts every server
    try:
        index = f"http://127.0.0.1:{spec.http_port}/v2/repository/index"
        wait_for(lambda: _live(spec.http_port), 30, "tritonserver to answer")
        cmdline = Path(f"/proc/{handle}/cmdline").read_bytes()
        assert b"s3cret-value" not in cmdline and secret.TOKEN.encode() in cmdline
        assert requests.post(index, timeout=5).status_code == 403
        assert requests.post(index, headers={"gantry-admin-key": secret.TOKEN}, timeout=5).status_code == 403
        assert requests.post(index, headers={"gantry-admin-key": "s3cret-value"}, timeout=5).status_code == 200
    finally:
        process.stop(handle, spec.repository, grace_s=10)


def test_without_the_library_or_the_file_the_server_does_not_start(tmp_path: Path):
    spec = _spec(tmp_path)
    server = _run(spec, process.server_environment())  # no LD_PRELOAD: the token is a malformed rule
    assert server.wait(timeout=30) != 0
    assert "--http-restricted-api option format is" in spec.log_path.read_text()

    files = secret.prepare(spec.admin_secret, tmp_path, tmp_path)
    files.rule.unlink()
    server = _run(spec, {**process.server_environment(), **files.environment()})
    assert server.wait(timeout=30) == 78
    assert f"gantry: cannot open the admin secret file {files.rule}" in spec.log_path.read_text()
