"""What the benchmarks share: a one-machine Gantry (SQLite, the web server) serving a
real tritonserver deployment, and percentiles."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# A p99 rests on its largest 1 %: below this many samples that is a handful of requests.
P99_SAMPLES = 1000


def tail_percentile(values: list[float], q: float) -> float | None:
    """percentile(values, q), or None for a q of 0.99 and up from fewer than P99_SAMPLES values."""
    return percentile(values, q) if q < 0.99 or len(values) >= P99_SAMPLES else None


def in_turn(sides: list, round_: int) -> list:
    """``sides`` in the order of round ``round_``: each round starts one side
    later, so no side always runs first (or right after another)."""
    shift = round_ % len(sides)
    return [*sides[shift:], *sides[:shift]]


def added_interval(ours: list[float], floor: list[float], q: float, draws: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval for percentile(ours, q) - percentile(floor, q): how far
    that difference may move by the luck of the samples alone (a p99 of 1000 samples
    rests on the ten largest, and on a tail both sides share)."""
    import numpy as np

    rng = np.random.default_rng(0)
    diffs = []
    for values in (ours, floor):
        array = np.asarray(values, dtype=float)
        drawn = np.sort(array[rng.integers(0, len(array), (draws, len(array)))], axis=1)
        diffs.append(drawn[:, min(len(array) - 1, int(q * len(array)))])
    low, high = np.percentile(diffs[0] - diffs[1], [2.5, 97.5])
    return float(low), float(high)


def add_database_argument(parser: Any) -> None:
    """``--database-url``: the PostgreSQL database a fleet-scale benchmark creates and seeds."""
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", "postgres://postgres:postgres@127.0.0.1:5432/gantry_bench"),
    )


def setup_postgres(database_url: str) -> None:
    """Django on the PostgreSQL database at ``database_url`` (made if missing, migrated), with
    the benchmark floors' views beside Gantry's (bench.floor.settings)."""
    import psycopg

    name = database_url.rsplit("/", 1)[1]
    with psycopg.connect(database_url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as admin:
        if not admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            admin.execute(f'CREATE DATABASE "{name}"')
    os.environ.update(
        DJANGO_SETTINGS_MODULE="bench.floor.settings",
        DATABASE_URL=database_url,
        SECRET_KEY=os.environ.get("SECRET_KEY", "gantry-bench-key"),
        GANTRY_PLAIN_HTTP="1",
        GANTRY_API_THROTTLE="off",
        GANTRY_MODEL_ROOTS="/",
        LOG_LEVEL="WARNING",  # the figures, not the servers' chatter
    )
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


@contextmanager
def server(argv: list[str], port: int, env: dict[str, str] | None = None) -> Iterator[None]:
    """Run ``argv`` (a server, with ``env`` added to this environment) until the
    block ends, once ``port`` answers."""
    process = subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    import socket

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    time.sleep(1)
    try:
        yield
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # daphne may wait on a client's request for good: the figures are taken already.
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def setup_django(port: int) -> Path:
    """Settings for a throw-away SQLite Gantry whose Triton ports follow ``port``; its folder."""
    work = Path(tempfile.mkdtemp(prefix="gantry-bench-"))
    os.environ.update(
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        DATABASE_URL=f"sqlite:///{work / 'bench.sqlite3'}",
        SECRET_KEY=os.environ.get("SECRET_KEY", "gantry-bench-key"),
        GANTRY_DATA_DIR=str(work / "data"),
        GANTRY_MODEL_ROOTS="/",
        GANTRY_HOST_NAME="bench-host",
        GANTRY_TRITON_PORT_RANGE=f"{port + 1}-{port + 30}",
        GANTRY_PLAIN_HTTP="1",  # a benchmark talks plain HTTP to localhost
        GANTRY_API_THROTTLE="off",  # and is one client measuring the server's ceiling
    )
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return work


@dataclass
class Served:
    deployment: Any
    triton: str  # host:port of Triton's HTTP endpoint
    web: str  # base URL of Gantry's ASGI server


@contextmanager
def served(*, port: int, models: dict[str, tuple[Path, str]], placements: list[Any]) -> Iterator[Served]:
    """Register ``models`` (name -> (folder, kind)), start a deployment of ``placements``
    with the worker's own launch code, mark it ready, and run the web server as make demo does."""
    from controlplane.serving import web_argv
    from deployments import states
    from deployments.services import deployments as deployment_services
    from deployments.services import registered_models, replicas
    from hosts.services import hosts
    from triton_server.client import TritonClient
    from triton_server.repository import write_repository
    from workers.deploy import plan

    host = hosts.host_heartbeat(name="bench-host", address="127.0.0.1", gpus=[])
    for name, (folder, kind) in models.items():
        model = registered_models.model_register(name=name, kind=kind, path=str(folder.resolve()), host=host.name)
        registered_models.model_inspect(model_id=model.pk, source="bench")
    deployment = deployment_services.deployment_create(name="bench", hosts=[host.name], placements=placements)
    # The deployment starts as a user's would (its one replica placed and launching); the
    # worker's own launch code starts the server here, in the bench's process.
    replicas.deployment_start(deployment_id=deployment.pk, source="bench")
    replica = plan.load(deployment.replica_set.get().pk)
    spec = plan.launch_spec(replica)
    write_repository(spec.repository, plan.model_specs(replica))
    runtime = plan.runtime_for(replica)
    handle = runtime.start(spec)
    web = None
    try:
        client = TritonClient(f"127.0.0.1:{replica.http_port}")
        client.wait_until_ready(spec.models, timeout_s=300, keep_waiting=lambda: runtime.is_running(handle, spec))
        client.close()
        for to in ("loading", "ready"):
            states.replica_transition(
                replica_id=replica.pk, to=to, source="bench", runtime_handle=handle if to == "loading" else None
            )
        web = subprocess.Popen(  # noqa: S603 - the product's own web server, as make demo runs it
            web_argv(sys.executable, bind="127.0.0.1", port=port), cwd=ROOT, env=os.environ.copy(),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(3)
        yield Served(deployment=deployment, triton=f"127.0.0.1:{replica.http_port}", web=f"http://127.0.0.1:{port}")
    finally:
        if web is not None:
            web.terminate()
            web.wait(timeout=20)
        runtime.stop(handle, spec)
