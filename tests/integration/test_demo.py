"""`make demo` as a user runs it (manage.py gantry_demo on SQLite, with the
Redis it starts itself): a worker SIGKILLed under it is started again, adopts
the running stack, and nothing else stops; a SIGKILLed web master leaves none
of its workers behind; Ctrl-C with the database unwritable still stops
everything, and the next start records those stops rather than counting
crashes; Ctrl-C leaves every row stopped, also after a PostgreSQL restart."""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
from pathlib import Path

import pytest
import requests

from tests.integration.conftest import PostgresServer, _spawn, free_port, free_ports, healthz_answers, wait_for
from workers import processes
from workers.runtimes import process

pytestmark = [pytest.mark.integration]


def _rows(database: Path, sql: str, *args: object) -> list[tuple]:
    try:
        with sqlite3.connect(database, timeout=5) as connection:
            return connection.execute(sql, args).fetchall()
    except sqlite3.OperationalError:
        return []  # not migrated yet, or busy


def _children(parent: int, marker: bytes) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and marker in argv:
            found.append(int(entry.name))
    return found


def _descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_the_demo_restarts_a_killed_worker_which_adopts_the_running_stack(tmp_path: Path):
    data_dir = tmp_path / "data"
    database = tmp_path / "demo.sqlite3"
    host = "demo-host"
    web_port, triton_base = free_ports(2), free_ports(30)
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{database}",
        "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # nothing answers: the demo starts its own
        "GANTRY_DATA_DIR": str(data_dir),
        "GANTRY_HOST_NAME": host,
        "GANTRY_HEARTBEAT_INTERVAL": "1",
        "GANTRY_TRITON_PORT_RANGE": f"{triton_base}-{triton_base + 29}",
        "GANTRY_ADMIN_PASSWORD": "demo-pass",
        "PYTHONUNBUFFERED": "1",
    }
    demo = _spawn([sys.executable, "manage.py", "gantry_demo", "--port", str(web_port)], env, tmp_path / "demo.log")
    try:
        ready = (
            "SELECT d.id, r.runtime_handle FROM deployments_deployment d JOIN deployments_replica r "
            "ON r.deployment_id = d.id WHERE d.name = 'demo-stack' AND d.status = 'ready'"
        )
        wait_for(lambda: _rows(database, ready), 420, "the demo stack to be ready")
        stack_id, server = _rows(database, ready)[0]
        (worker,) = _children(demo.pid, b"workers.hostworker")
        os.kill(worker, signal.SIGKILL)

        adopted = "SELECT message FROM deployments_event WHERE kind = 'deployment.adopted' AND deployment_id = ?"
        wait_for(lambda: _rows(database, adopted, stack_id), 60, "the new worker to adopt the stack")
        restarted = "SELECT message FROM deployments_event WHERE kind = 'host.process_restarted'"
        assert "worker process exited (killed by SIGKILL)" in _rows(database, restarted)[0][0]
        assert demo.poll() is None  # nothing else stopped
        assert _rows(database, ready) == [(stack_id, server)]  # the same server, never a second one
        assert [handle for handle, _ in process.servers_under(data_dir)] == [server]
        assert requests.get(f"http://127.0.0.1:{web_port}/healthz", timeout=10).status_code == 200
        assert len(_children(demo.pid, b"workers.hostworker")) == 1

        # A SIGKILLed web master: its workers go with it before a new one starts.
        (master,) = _children(demo.pid, b"gunicorn")
        old_workers = _descendants(master)
        assert old_workers
        os.kill(master, signal.SIGKILL)
        wait_for(lambda: not any(_alive(pid) for pid in old_workers), 30, "the old web workers to be stopped")
        wait_for(lambda: _children(demo.pid, b"gunicorn"), 30, "a new web master")
        wait_for(lambda: healthz_answers(f"http://127.0.0.1:{web_port}"), 60, "the web again")

        # Ctrl-C while the database takes no writes (stopping a deployment is one):
        # everything the demo started still stops.
        started = _descendants(demo.pid)
        lock = sqlite3.connect(database, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")
        try:
            demo.send_signal(signal.SIGINT)
            demo.wait(timeout=120)
        finally:
            lock.rollback()
            lock.close()
        assert [pid for pid in started if _alive(pid)] == []
        assert process.servers_under(data_dir) == []
        assert demo.returncode == 0
        # The database took no writes: the rows still say the stack runs.
        assert _rows(database, "SELECT status FROM deployments_replica") == [("ready",)]

        # The next start records those stops before its worker starts: no crash
        # is counted, the stack comes back, and this Ctrl-C leaves every row stopped.
        demo = _spawn([sys.executable, "manage.py", "gantry_demo", "--port", str(web_port)], env, tmp_path / "demo.log")
        restarted_stack = lambda: [row for row in _rows(database, ready) if row[1] != server]  # noqa: E731 - a new server
        wait_for(restarted_stack, 420, "the demo stack to be ready again, on a new server")
        # Through the normal path: asked (stopping, at once: a server gone has nothing to drain),
        # then stopped by the worker.
        moves = "SELECT to_status, message FROM deployments_event WHERE kind = 'replica.status' ORDER BY id"
        rows = _rows(database, moves)
        last_stop = max(i for i, (to, _) in enumerate(rows) if to == "stopping")
        assert rows[last_stop][1].endswith("stop requested (now: requests in flight are cut)"), rows
        assert rows[last_stop + 1][0] == "stopped", rows
        assert _crashes(database) == []
        demo.send_signal(signal.SIGINT)
        demo.wait(timeout=120)
        assert _statuses(database) == {"stopped"}
        assert _crashes(database) == []
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGINT)  # Ctrl-C
            try:
                demo.wait(timeout=120)
            except Exception:  # noqa: BLE001 - make sure nothing is left behind
                processes.terminate_group(demo.pid, grace_s=5)
        for handle, repository in process.servers_under(data_dir):
            process.stop(handle, repository)
        _tell(tmp_path / "demo.log", data_dir)
    assert demo.returncode == 0
    assert process.servers_under(data_dir) == []


def _tell(demo_log: Path, data_dir: Path) -> None:
    """The demo's own output and the end of each child's log (pytest shows them on a failure)."""
    sys.stderr.write(demo_log.read_text(errors="replace")[-4000:])
    for log in sorted((data_dir / "logs").glob("*.log")):
        sys.stderr.write(f"\n--- {log.name}\n{log.read_text(errors='replace')[-3000:]}")


def _statuses(database: Path) -> set[str]:
    """Every deployment's and replica's status."""
    return {
        status
        for table in ("deployments_deployment", "deployments_replica")
        for (status,) in _rows(database, f"SELECT status FROM {table}")  # noqa: S608 - two fixed names
    }


def _crashes(database: Path) -> list[tuple]:
    return _rows(
        database,
        "SELECT kind, message FROM deployments_event WHERE kind LIKE 'deployment.crash%' "
        "OR message LIKE '%exited unexpectedly%'",
    )


def test_ctrl_c_after_a_postgres_restart_stops_every_row_and_the_next_start_counts_no_crash(
    own_postgres: PostgresServer, tmp_path: Path
):
    import psycopg

    web_port, triton_base = free_ports(3), free_ports(30)
    env = {
        **os.environ,
        "DATABASE_URL": own_postgres.url,
        "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        "GANTRY_DATA_DIR": str(tmp_path / "data"),
        "GANTRY_HOST_NAME": "demo-pg-host",
        "GANTRY_HEARTBEAT_INTERVAL": "1",
        "GANTRY_TRITON_PORT_RANGE": f"{triton_base}-{triton_base + 29}",
        "GANTRY_ADMIN_PASSWORD": "demo-pass",
        "PYTHONUNBUFFERED": "1",
    }

    def rows(sql: str) -> list[tuple]:
        try:
            with psycopg.connect(own_postgres.url, connect_timeout=3) as connection:
                return connection.execute(sql).fetchall()
        except psycopg.Error:
            return []

    statuses = (
        "SELECT status FROM deployments_deployment WHERE name = 'demo-stack' "
        "UNION ALL SELECT status FROM deployments_replica"
    )
    crashes = (
        "SELECT kind, message FROM deployments_event WHERE kind LIKE 'deployment.crash%' "
        "OR message LIKE '%exited unexpectedly%'"
    )
    argv = [sys.executable, "manage.py", "gantry_demo", "--port", str(web_port)]
    demo = _spawn(argv, env, tmp_path / "demo.log")
    try:
        wait_for(lambda: rows(statuses) == [("ready",), ("ready",)], 420, "the demo stack to be ready")
        own_postgres.stop()
        own_postgres.start()
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=120) == 0
        assert process.servers_under(tmp_path / "data") == []
        assert rows(statuses) == [("stopped",), ("stopped",)]

        demo = _spawn(argv, env, tmp_path / "demo.log")
        wait_for(lambda: rows(statuses) == [("ready",), ("ready",)], 420, "the demo stack to be ready again")
        assert rows(crashes) == []
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGINT)
            try:
                demo.wait(timeout=120)
            except Exception:  # noqa: BLE001 - make sure nothing is left behind
                processes.terminate_group(demo.pid, grace_s=5)
        for handle, repository in process.servers_under(tmp_path / "data"):
            process.stop(handle, repository)
        _tell(tmp_path / "demo.log", tmp_path / "data")
