"""Process groups for real: started in their own group, recognised by a marker
so a reused pid is never signalled, stopped TERM-then-KILL with every child."""

from __future__ import annotations

import subprocess
import sys
import time

from workers import processes

# A parent that starts a child in its group, then (optionally) ignores SIGTERM.
TREE = """
import signal, subprocess, sys, time
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("started", flush=True)
time.sleep(60)
"""


def _tree(mode: str) -> subprocess.Popen:
    process = processes.start_group([sys.executable, "-c", TREE, mode, "--gantry-test-marker"], stdout=subprocess.PIPE)
    assert process.stdout.readline().strip() == b"started"
    return process


def test_a_group_is_ours_by_its_marker_and_stops_with_its_children():
    process = _tree("polite")
    try:
        assert processes.is_ours(process.pid, argv_contains=b"--gantry-test-marker")
        assert not processes.is_ours(process.pid, argv_contains=b"--someone-else")
        assert len(processes.group_members(process.pid)) == 2
        processes.terminate_group(process.pid, grace_s=5)
        assert processes.group_members(process.pid) == []
        assert not processes.is_alive(process.pid)
    finally:
        processes.terminate_group(process.pid, grace_s=0)


def test_a_leader_that_ignores_sigterm_is_killed_after_the_grace():
    process = _tree("stubborn")
    started = time.monotonic()
    processes.terminate_group(process.pid, grace_s=1)
    assert 1 <= time.monotonic() - started < 10
    assert processes.group_members(process.pid) == []
    assert process.wait(timeout=5) == -9


def test_a_leader_that_is_not_ours_is_never_signalled():
    process = _tree("polite")
    try:
        processes.terminate_group(process.pid, grace_s=1, leader_running=lambda: False)
        # Not ours, so untouched: only stray members of a group we own would be killed.
        assert processes.is_alive(process.pid) or processes.group_members(process.pid) == []
    finally:
        processes.terminate_group(process.pid, grace_s=0)


def test_exits_are_described_by_code_or_signal():
    assert processes.describe_exit(3) == "exit code 3"
    assert processes.describe_exit(-9) == "killed by SIGKILL"
    assert processes.describe_exit(None) == "still running"


def test_how_a_process_ended_is_read_from_its_zombie_or_from_whoever_collected_it():
    killed = processes.start_group([sys.executable, "-c", "import time; time.sleep(60)"])
    processes.terminate_group(killed.pid, grace_s=0)  # nobody has waited for it yet: a zombie
    assert processes.zombie_returncode(killed.pid) in (-15, -9)
    exited = processes.start_group([sys.executable, "-c", "raise SystemExit(3)"])
    deadline = time.monotonic() + 10
    while processes.zombie_returncode(exited.pid) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes.zombie_returncode(exited.pid) == 3
    assert processes.reap(exited.pid) == 3  # its parent (this process) collects it
    assert processes.zombie_returncode(exited.pid) is None
    assert processes.reap(exited.pid) is None


def test_a_process_that_hides_its_command_line_is_ours_by_its_working_directory(tmp_path):  # noqa: ANN001
    ours, elsewhere = tmp_path / "run" / "0-gateway", tmp_path / "other"
    ours.mkdir(parents=True)
    elsewhere.mkdir()
    process = processes.start_group([sys.executable, "-c", "import time; time.sleep(60)"], cwd=ours)
    try:
        assert processes.is_ours(process.pid, cwd_under=tmp_path / "run")
        assert not processes.is_ours(process.pid, cwd_under=elsewhere)
    finally:
        processes.terminate_group(process.pid)
        process.wait()
    assert not processes.is_ours(process.pid, cwd_under=tmp_path / "run")
