"""What a program Gantry runs for a user sees of the worker's environment: an
allow-list, so the worker's settings and a host's other secrets stay out."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers import processes
from workers.runtimes.process import server_environment

SECRETS = {
    "DATABASE_URL": "postgres://gantry:hunter2@db/gantry",
    "SECRET_KEY": "django-secret",
    "REDIS_URL": "redis://:pw@redis/0",
    "HF_TOKEN": "hf_abc",
    "GANTRY_HUB_TOKEN": "hf_the_hosts_own",
    "GANTRY_HUB_TOKEN_FILE": "/etc/gantry/hub-token",
    "AWS_SECRET_ACCESS_KEY": "aws",
    "GANTRY_ADMIN_PASSWORD": "admin",
}


@pytest.fixture
def worker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**SECRETS, "CUDA_VISIBLE_DEVICES": "1", "LC_ALL": "C.UTF-8", "AIPERF_LOG": "x"}.items():
        monkeypatch.setenv(name, value)


def test_a_child_sees_the_allow_list_and_what_it_is_given(worker_env: None) -> None:
    env = processes.child_environment({"HF_HUB_OFFLINE": "1"})
    assert not set(SECRETS) & set(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["LC_ALL"] == "C.UTF-8" and env["AIPERF_LOG"] == "x"
    assert env["HF_HUB_OFFLINE"] == "1" and "PATH" in env


def test_tritonserver_and_its_model_code_get_no_secret(worker_env: None) -> None:
    env = server_environment({"LD_PRELOAD": "/x.so"})
    assert not set(SECRETS) & set(env)
    assert env["HF_HUB_OFFLINE"] == "1" and env["LD_PRELOAD"] == "/x.so"


def test_no_worker_module_hands_its_whole_environment_to_a_child() -> None:
    root = Path(processes.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "**os.environ" not in text and "dict(os.environ)" not in text, path
