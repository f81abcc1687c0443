"""What every runtime shares: the Runtime interface, how a server ended, and the
host's port probe.

Both runtimes (runtimes.process, runtimes.docker) take the same LaunchSpec
(triton_server.server) and
hand back an opaque handle (a process id, a container id) that Gantry stores
on the deployment.
"""

from __future__ import annotations

import signal
import socket
from dataclasses import dataclass
from typing import Any, Protocol

from triton_server.server import LaunchSpec
from workers import processes

# The most server log lines the agent ships per deployment and heartbeat.
MAX_LOG_LINES = 500


@dataclass(frozen=True)
class ServerExit:
    """How a server ended, as far as its runtime can tell: a Popen-style return
    code (negative: the signal that killed it; None: not known) and whether the
    kernel's OOM killer ended it."""

    returncode: int | None
    oom_killed: bool = False
    unknown_why: str = ""

    def describe(self) -> str:
        if self.oom_killed:
            return "killed by the kernel's OOM killer (out of memory)"
        if self.returncode is None:
            return f"exit status unknown ({self.unknown_why or 'its runtime did not keep it'})"
        described = processes.describe_exit(self.returncode)
        if self.returncode == -signal.SIGKILL:
            return f"{described} (by a person, or by the kernel's OOM killer when memory ran out)"
        return described

    def as_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"returncode": self.returncode, "oom_killed": self.oom_killed}
        if self.returncode is not None and self.returncode < 0:
            data["signal"] = -self.returncode
        return data


def busy_ports(address: str, ports: list[int]) -> list[int]:
    """The ports among ``ports`` that something on this host already listens on."""
    busy = []
    for port in ports:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
            # As Triton binds: connections of a server that just died linger in
            # TIME_WAIT and must not count as busy; a listener still does.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((address, port))
            except OSError:
                busy.append(port)
    return busy


class Runtime(Protocol):
    def start(self, spec: LaunchSpec) -> str: ...

    def is_running(self, handle: str, spec: LaunchSpec) -> bool: ...

    def stop(self, handle: str, spec: LaunchSpec) -> None: ...

    def log_tail(self, handle: str, spec: LaunchSpec, lines: int = 20) -> str: ...

    def read_log(self, handle: str, spec: LaunchSpec, cursor: float | None) -> tuple[list[str], float]:
        """Server log lines written since ``cursor`` (None: only the recent ones), and the
        next cursor; TransientError, saying why, when the log cannot be read."""
        ...

    def server_changes(self, handle: str, spec: LaunchSpec) -> list[str]:
        """Why the running server cannot take ``spec`` in place (a new server must
        start): in words, none when a reload of the changed models is enough."""
        ...

    def pids(self, handle: str, spec: LaunchSpec) -> list[int]:
        """Host process ids of the server and its children (model stubs, MPI ranks)."""
        ...

    def exit_of(self, handle: str, spec: LaunchSpec) -> ServerExit:
        """How the server behind ``handle``, no longer running, ended."""
        ...

    def stop_leftovers(self, spec: LaunchSpec) -> list[str]:
        """Stop servers of ``spec``'s deployment that no row records (a worker died
        between starting one and recording it); their handles."""
        ...
