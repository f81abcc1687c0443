"""Model code as a user of its own (workers.model_user): run for real as
`nobody`, which every Linux has; the switch needs root, as CI runs."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from common.errors import PermanentError
from workers import model_user

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users takes root here")


def test_without_a_model_user_model_code_runs_as_the_worker(settings):
    settings.GANTRY_MODEL_USER = ""
    assert model_user.model_user() is None
    assert model_user.run_as(["tritonserver"]) == ["tritonserver"]


@pytest.mark.parametrize(
    ("name", "said"),
    [("no-such-user-here", "there is no user 'no-such-user-here'"), ("root", "is root")],
)
def test_a_model_user_that_would_not_keep_secrets_from_model_code_is_refused(settings, name: str, said: str):
    settings.GANTRY_MODEL_USER = name
    with pytest.raises(PermanentError, match="GANTRY_MODEL_USER") as refused:
        model_user.run_as(["tritonserver"])
    assert said in str(refused.value)


@needs_root
def test_model_code_runs_as_the_model_user_without_groups_capabilities_or_the_workers_secrets(settings, tmp_path):
    settings.GANTRY_MODEL_USER = "nobody"
    secret = tmp_path / "gantry.env"
    secret.write_text("DATABASE_URL=postgres://host:pw@db/gantry\n")
    secret.chmod(0o600)
    tmp_path.chmod(0o755)
    # The worker's own environment holds its secrets; the model's is made for it (processes.child_environment).
    script = (
        "grep -E '^(Uid|Groups|CapEff|CapPrm|CapAmb):' /proc/self/status | tr -s '\\t' ' '; "
        'for path in "$0" /proc/$PPID/environ; do cat "$path" >/dev/null 2>&1 && echo read || echo refused; done'
    )
    argv = model_user.run_as(["sh", "-c", script, str(secret)])
    ran = subprocess.run(argv, capture_output=True, text=True, check=True)
    assert ran.stdout.splitlines() == [
        "Uid: 65534 65534 65534 65534",  # nobody, real, effective, saved and filesystem
        "Groups: ",  # no supplementary group: not docker's
        "CapPrm: 0000000000000000",
        "CapEff: 0000000000000000",
        "CapAmb: 0000000000000000",
        "refused",  # the settings file
        "refused",  # the worker's /proc/<pid>/environ
    ], ran.stdout


@needs_root
def test_the_model_gets_a_folder_of_its_own_which_the_worker_removes_as_that_user(settings):
    settings.GANTRY_MODEL_USER = "nobody"
    root = Path(tempfile.mkdtemp(prefix="gantry-test-model-user-"))  # pytest's folders are closed to other users
    root.chmod(0o755)
    replica = root / "r1"
    replica.mkdir()
    own = model_user.own_folder(replica)
    assert (own.stat().st_uid, stat.S_IMODE(own.stat().st_mode)) == (65534, 0o700)
    env = model_user.environment(own)
    assert env["HOME"] == str(own) and env["HF_MODULES_CACHE"].startswith(str(own))
    subprocess.run(model_user.run_as(["mkdir", "-p", str(own / "cache" / "deep")]), check=True)
    try:
        model_user.remove_folders(root)
        assert not own.exists() and replica.is_dir()
    finally:
        shutil.rmtree(root)


def test_the_check_says_whether_model_code_runs_apart(settings):
    from workers.hostcheck import MISSING, WARN, _model_user

    settings.GANTRY_MODEL_USER = ""
    assert _model_user().state == WARN
    settings.GANTRY_MODEL_USER = "no-such-user-here"
    assert _model_user().state == MISSING


@needs_root
def test_the_check_names_what_the_model_user_cannot_read(settings, python_open_to_other_users):
    from workers.hostcheck import MISSING, OK, _model_user

    settings.GANTRY_MODEL_USER = "nobody"
    data = Path(tempfile.mkdtemp(prefix="gantry-test-model-user-"))
    try:
        settings.GANTRY_DATA_DIR = data
        data.chmod(0o700)  # the worker's alone
        closed = _model_user()
        assert closed.state == MISSING and str(data) in closed.detail, closed
        data.chmod(0o755)
        assert _model_user().state == OK, _model_user()
    finally:
        shutil.rmtree(data)


def test_only_a_worker_that_is_not_root_gets_capabilities_in_its_unit():
    from controlplane.cli import systemd_unit

    unit = systemd_unit("worker", executable="gantry", env_file="/etc/gantry/gantry.env", user="gantry",
                        model_user="gantry-model")  # fmt: skip
    assert "AmbientCapabilities=CAP_CHOWN CAP_KILL CAP_SETGID CAP_SETUID" in unit.splitlines()
    assert "CapabilityBoundingSet=CAP_CHOWN CAP_KILL CAP_SETGID CAP_SETUID" in unit.splitlines()
    for plain in (
        systemd_unit("worker", executable="gantry", env_file="/e", user="root", model_user="gantry-model"),
        systemd_unit("worker", executable="gantry", env_file="/e", user="gantry"),
    ):
        assert "Capabilit" not in plain
