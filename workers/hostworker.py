"""A GPU host's worker: two Celery workers under one process, so that control
work never waits behind a long job.

- The control worker consumes the host's control queue (launch, stop, apply,
  inspect, forget) and runs the host agent (workers.agent).
- The jobs worker consumes the host's jobs queue (engine builds and load tests,
  which may run for an hour).

Celery's slots are per worker, not per queue: one worker consuming both queues
would let a build and a load test hold every slot while a Stop waits. Both
workers are forked from this process and stay in its process group, so
signalling the group stops all of it. A SIGTERM or SIGINT here is passed on to
both as a warm shutdown. If either worker exits, the other is stopped and this
process exits with the first one's status, so whatever supervises the worker
(systemd, compose, the demo) restarts a whole one. Each worker dies with this
process (PR_SET_PDEATHSIG), even if it is killed outright. As a container's
PID 1 it reaps the orphans the container's processes leave.

Usage: python -m workers.hostworker <host-name> [celery worker options...]
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import traceback

from common import metrics_folder
from core.queues import host_queue, jobs_queue

# Slots per worker: control work is short and rarely concurrent; jobs are a
# build beside a load test.
CONTROL_SLOTS = 2
JOB_SLOTS = 2
# How long a worker gets to finish its tasks once the other one has died.
STOP_GRACE_S = 30.0
_PR_SET_PDEATHSIG = 1


def celery_arguments(host_name: str, *, jobs: bool, extra: list[str] | None = None) -> list[str]:
    """The ``celery`` command-line arguments of one of the host's two workers."""
    queue, node, slots = (
        (jobs_queue(host_name), f"gantry-jobs@{host_name}", JOB_SLOTS)
        if jobs
        else (host_queue(host_name), f"gantry@{host_name}", CONTROL_SLOTS)
    )
    # No gossip, mingle, heartbeat events or remote control: each uses a shared
    # fanout key that a host's Redis user may not touch (hosts.grants).
    quiet = ["--without-gossip", "--without-mingle", "--without-heartbeat"]
    argv = ["-A", "controlplane", "worker", "-Q", queue, "-n", node, "-c", str(slots), "-l", "INFO", *quiet]
    return [*argv, *(extra or [])]


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _fork_celery(arguments: list[str]) -> int:
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            signal.signal(number, signal.SIG_DFL)
        _die_with_parent(parent)
        from celery.__main__ import main as celery_main

        sys.argv = ["celery", *arguments]
        celery_main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child must never return into the parent's code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return pid  # never reached


def run(host_name: str, extra: list[str]) -> int:
    """Run the host's two workers until one exits or a stop is asked for."""
    # Both workers and their children write Prometheus samples there; the agent's /metrics reads them all.
    metrics_folder.prepare("gantry-worker-metrics-")
    try:
        return _run(host_name, extra)
    finally:
        metrics_folder.remove_made()


def _run(host_name: str, extra: list[str]) -> int:
    workers = {
        _fork_celery(celery_arguments(host_name, jobs=jobs, extra=extra)): name
        for jobs, name in ((False, "control worker"), (True, "jobs worker"))
    }
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for pid in workers:
            _signal(pid, signal.SIGQUIT if signum == signal.SIGQUIT else signal.SIGTERM)

    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(number, stop)

    pid, status = _wait_for_one_of(workers)
    first = os.waitstatus_to_exitcode(status)
    name = workers.pop(pid)
    if not stopping:
        sys.stderr.write(f"gantry worker: the {name} exited ({first}); stopping the other\n")
        for other in workers:
            _signal(other, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while workers:
        waited, _ = os.waitpid(-1, os.WNOHANG)
        if waited:
            workers.pop(waited, None)
        elif time.monotonic() >= deadline:
            for other in workers:
                _signal(other, signal.SIGKILL)
            deadline = float("inf")
        else:
            time.sleep(0.1)
    return first if first > 0 else (0 if stopping else 1)


def _wait_for_one_of(workers: dict[int, str]) -> tuple[int, int]:
    """Until one of ``workers`` exits. As a container's PID 1 this process also
    inherits every orphan (a stopped tritonserver's stubs): those are reaped
    here, as an init must, and otherwise ignored."""
    while True:
        pid, status = os.wait()
        if pid in workers:
            return pid, status


def _signal(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if not arguments or arguments[0].startswith("-"):
        sys.stderr.write(__doc__.rsplit("Usage: ", 1)[1])
        return 2
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    return run(arguments[0], arguments[1:])


if __name__ == "__main__":
    sys.exit(main())
