"""How a process-runtime server ended, for real: a tritonserver stand-in killed
by a signal, seen by the process that started it and by one that did not."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from workers import processes
from workers.runtimes import process
from workers.runtimes.base import ServerExit


def _server(repository: Path) -> str:
    repository.mkdir(parents=True)
    argv = [sys.executable, "-c", "import time; time.sleep(60)", f"--model-repository={repository}"]
    return str(processes.start_group(argv).pid)


def test_a_server_killed_by_a_signal_says_so_before_and_after_it_is_collected(tmp_path: Path):
    repository = tmp_path / "deployment" / "repository"
    handle = _server(repository)
    assert process.is_running(handle, repository)
    os.kill(int(handle), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while processes.zombie_returncode(int(handle)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # Another process asking (the agent, while a worker process is its parent): the zombie tells.
    assert process.exit_of(handle, repository) == ServerExit(-signal.SIGKILL)
    # Its parent notices and collects it: what it collected is kept for whoever asks next.
    assert not process.is_running(handle, repository)
    assert processes.zombie_returncode(int(handle)) is None
    ended = process.exit_of(handle, repository)
    assert ended == ServerExit(-signal.SIGKILL)
    assert ended.describe().startswith("killed by SIGKILL")
    assert "OOM killer" in ended.describe()
    assert ended.as_data() == {"returncode": -9, "oom_killed": False, "signal": 9}


def test_an_exit_nobody_kept_is_called_unknown(tmp_path: Path):
    ended = process.exit_of("999999", tmp_path / "repository")
    assert ended.returncode is None
    assert ended.describe() == "exit status unknown (the worker that started it was gone when it ended)"


def test_an_oom_kill_is_named():
    assert ServerExit(-9, oom_killed=True).describe() == "killed by the kernel's OOM killer (out of memory)"
    assert ServerExit(3).describe() == "exit code 3"
