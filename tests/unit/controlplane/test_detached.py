"""Daemons that Gantry's scripts start keep none of the caller's descriptors: a
dockerd started by `make test` once held the caller's lock and CI's pipe."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def test_a_detached_command_holds_only_its_standard_descriptors() -> None:
    read, write = os.pipe()
    child = subprocess.Popen([SCRIPTS / "detached.sh", "sleep", "30"], pass_fds=[write], stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/comm").read_text().strip() != "sleep" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(int(fd) for fd in os.listdir(f"/proc/{child.pid}/fd")) == [0, 1, 2]
        assert os.getsid(child.pid) == child.pid  # a session of its own
        os.close(write)
        os.set_blocking(read, False)
        assert os.read(read, 1) == b""  # the pipe's only writer was ours: it reads as closed
    finally:
        child.kill()
        child.wait()
        os.close(read)


def test_every_daemon_the_scripts_start_goes_through_detached() -> None:
    starts = re.compile(r"^\s*[^#]*\b(dockerd --|redis-server --daemonize|pg_ctlcluster .* start)")
    for script in SCRIPTS.glob("ensure-*.sh"):
        for line in script.read_text().splitlines():
            if starts.search(line):
                assert "detached.sh" in line, f"{script.name}: {line.strip()}"
