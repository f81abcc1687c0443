"""Host processes Gantry starts and stops: the process runtime's tritonserver,
native build steps, and the demo's own children.

Each is started as the leader of its own process group, so everything it
starts (python-backend stubs, MPI ranks, compiler workers) is stopped with it.
A recorded pid may have been reused by another program since, so callers say
what makes a process theirs (a marker in its command line or environment)
before anything is signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from common.errors import PermanentError

# What a program Gantry runs for a user (tritonserver and the model code in its
# stubs, build steps, load generators) may see of the worker's environment. An
# allow-list: the worker's own settings (the database and broker addresses with
# their passwords, the secret key) and anything else a host carries (a hub
# token, a cloud key) stay out unless named here.
CHILD_ENV_NAMES = frozenset(
    "PATH HOME USER LOGNAME SHELL TERM LANG LANGUAGE TZ TMPDIR LD_LIBRARY_PATH PYTHONPATH VIRTUAL_ENV HF_HOME "
    "HF_HUB_CACHE TORCH_HOME XDG_CACHE_HOME OMP_NUM_THREADS MKL_NUM_THREADS SSL_CERT_FILE SSL_CERT_DIR".split()
)
CHILD_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "NCCL_", "OMPI_", "PMIX_", "UCX_", "AIPERF_")


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a program Gantry runs for a user: the allow-listed part
    of this process's environment, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k in CHILD_ENV_NAMES or k.startswith(CHILD_ENV_PREFIXES)}
    env.update(extra or {})
    return env


def start_group(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    stdout: IO[bytes] | int | None = None,
) -> subprocess.Popen:
    """Start ``argv`` as the leader of a new process group (and session), so a
    terminal's Ctrl-C does not reach it and ``terminate_group`` stops all of it."""
    try:
        return subprocess.Popen(  # noqa: S603 - callers compose argv from fixed binaries
            argv,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not None else None,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    except OSError as exc:
        raise PermanentError(f"could not start {argv[0]}: {exc}") from exc


def reap(pid: int) -> int | None:
    """Collect ``pid``'s exit status if it is our child and has exited (no zombie
    left); its Popen-style return code when this call collected it."""
    try:
        waited, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status) if waited else None


def zombie_returncode(pid: int) -> int | None:
    """The Popen-style return code of ``pid`` if it has exited and its parent
    has not collected it yet (Linux keeps it in /proc/<pid>/stat, field 52)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] != "Z" or len(fields) < 50:
        return None
    return os.waitstatus_to_exitcode(int(fields[49]))


def _proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of ``pid``, or None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[2])


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an exited child nobody waited for)."""
    state = _proc_state(pid)
    return state is not None and state[0] not in {"Z", "X"}


# How long a command line may read empty while its process is alive: the
# kernel closes the exec error pipe (Popen returns) before it maps the new
# program's arguments, so a process seen at once can show none for a moment.
EXEC_SETTLE_S = 1.0


def command_line(pid: int) -> list[bytes]:
    """``pid``'s arguments as /proc shows them; waits out the moment an exec
    that just returned to its parent shows none. Raises OSError when it is gone."""
    deadline = time.monotonic() + EXEC_SETTLE_S
    while True:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        if raw or not is_alive(pid) or time.monotonic() >= deadline:
            return raw.split(b"\0")[:-1] if raw.endswith(b"\0") else raw.split(b"\0")
        time.sleep(0.01)


def is_ours(
    pid: int,
    *,
    argv_contains: bytes | None = None,
    env_contains: bytes | None = None,
    cwd_under: Path | None = None,
) -> bool:
    """True while ``pid`` is alive and still the process we started: its command
    line has the argument ``argv_contains`` / its environment the entry
    ``env_contains`` / its working directory is in ``cwd_under`` (a pid reused
    by another program has none of them). A program that sets its process title
    (setproctitle) overwrites its command line and environment as /proc shows
    them; its working directory stays."""
    if not is_alive(pid):
        return False
    try:
        if argv_contains is not None and argv_contains not in command_line(pid):
            return False
        if env_contains is not None and env_contains not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            return False
        if cwd_under is not None and not Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(cwd_under):
            return False
    except OSError:
        return False
    return True


def working_in(folder: Path) -> list[int]:
    """Live processes whose working directory is in ``folder`` (how a program that
    hides its command line is found without a recorded pid)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if Path(os.readlink(entry / "cwd")).is_relative_to(folder) and is_alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def stop_groups_working_in(folder: Path, *, grace_s: float = 10.0) -> None:
    """Stop the process group of every live process working in ``folder``: what a
    dead worker's load generators left (each has a group of its own, so it
    outlives a SIGKILLed worker). Found by working directory, a reused pid is
    never signalled."""
    groups = set()
    for pid in working_in(folder):
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(pid))
    for pgid in groups:
        terminate_group(pgid, grace_s=grace_s)


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            state = _proc_state(int(entry.name))
            if state is not None and state[1] == pgid and state[0] not in {"Z", "X"}:
                members.append(int(entry.name))
    return members


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``condition`` until it holds or ``timeout_s`` passes; whether it held."""
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def terminate_group(
    pgid: int,
    *,
    grace_s: float = 10.0,
    leader_running: Callable[[], bool] | None = None,
    first_signal: signal.Signals = signal.SIGTERM,
) -> None:
    """Signal the group led by ``pgid`` (SIGTERM, or ``first_signal``: SIGINT
    asks a program to stop as Ctrl-C would); SIGKILL whatever is left after ``grace_s``.

    ``leader_running`` says whether the leader is still the process we mean
    (default: any member of the group lives); the group is signalled only then,
    so a reused pid is never touched. Returns once the group is gone; the
    leader's exit status is left for whoever started it to collect (``reap``,
    or its Popen's ``wait``).
    """
    running = leader_running or (lambda: bool(group_members(pgid)))
    if running():
        _signal_group(pgid, first_signal)
        _wait(lambda: not running(), grace_s)
    # Children (stubs, ranks) normally exit with their leader; make sure none is left.
    if running() or group_members(pgid):
        _signal_group(pgid, signal.SIGKILL)
        _wait(lambda: not running() and not group_members(pgid), 10)


def describe_exit(returncode: int | None) -> str:
    """'exit code 3' or 'killed by SIGKILL' for a Popen-style return code."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
