"""Benchmark: what node restriction costs a host's writes, and how many database
connections a host holds. Needs PostgreSQL and Redis; one run prints:

- **a beat, a replica's report, an event**, each timed as the host makes it
  (the same services its worker calls): once with the host's own role, under
  the grants and row-level policies of hosts.grants, and once with
  the control plane's role (the floor: no policy applies to a table's owner,
  which is what every host used before node restriction). The two sides run
  in separate processes, alternating which goes first every round;
  p50/p99 of each side and the ratio.
- **connections per host**: a real host worker (workers.hostworker) started
  with the host's joined credentials, idle, and the sessions its role holds.

    make bench-host-path            # or: python bench/host_path.py --help
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import add_database_argument, percentile, setup_postgres  # noqa: E402

HOST = "bench-host"
OPERATIONS = ("beat", "report", "event")


def _prepare() -> dict[str, str]:
    """A joined host serving one deployment; its database and Redis URLs."""
    from deployments.models import Deployment, Replica
    from hosts import grants
    from hosts.models import GpuHost, HostCredential
    from hosts.services import host_join

    for credential in HostCredential.objects.filter(host__name=HOST):
        grants.database_role_drop(credential.database_role)
        grants.redis_user_remove(credential.redis_user)
    Deployment.objects.filter(name="bench-served").delete()
    GpuHost.objects.filter(name=HOST).delete()
    token = host_join.host_join_token_create(user=None, host_name=HOST).secret
    joined = host_join.host_join(token=token, name=HOST, address="127.0.0.1", gateway_url="")
    deployment = Deployment.objects.create(name="bench-served", status="ready")
    ports = {"http_port": 29000, "grpc_port": 29001, "metrics_port": 29002}
    Replica.objects.create(deployment=deployment, serial=1, host=joined.host, generation=1, status="ready", **ports)
    return {"database_url": joined.database_url, "redis_url": joined.redis_url, "deployment": str(deployment.pk)}


def _side(samples: int, deployment_id: int) -> dict[str, list[float]]:
    """Run in a child whose DATABASE_URL is one side's: each operation ``samples`` times (ms)."""
    from core import events
    from deployments.models import Deployment, Replica
    from deployments.services import telemetry
    from hosts.models import GpuHost
    from hosts.services import hosts

    gpu = hosts.GpuReport(index=0, uuid="GPU-bench", name="NVIDIA H100", compute_capability="9.0",
                          memory_total_bytes=85_000_000_000)  # fmt: skip
    replica = Replica.objects.get(deployment_id=deployment_id)
    deployment, host = Deployment.objects.get(pk=deployment_id), GpuHost.objects.get(name=HOST)
    figures = {"minilm": {"request_rate": 1.0, "queue_ms": 0.1, "pending": 0.0}}
    operations = {
        "beat": lambda: hosts.host_heartbeat(name=HOST, gpus=[gpu]),
        "report": lambda: telemetry.metrics_record(
            deployment_id=deployment_id, replica_id=replica.pk, models=figures, gpus={}
        ),
        "event": lambda: events.record(
            kind="bench.event", source=f"worker:{HOST}", deployment=deployment, host=host, message="a replica's report"
        ),  # fmt: skip
    }
    times: dict[str, list[float]] = {name: [] for name in OPERATIONS}
    for _ in range(samples):
        for name, operation in operations.items():
            began = time.perf_counter()
            operation()
            times[name].append((time.perf_counter() - began) * 1000)
    return times


def _run_side(database_url: str, samples: int, deployment_id: int) -> dict[str, list[float]]:
    env = {**os.environ, "DATABASE_URL": database_url}
    argv = [sys.executable, __file__, "--side", str(samples), "--deployment", str(deployment_id)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def _connections(joined: dict[str, str], role: str) -> int:
    """Sessions a real, idle host worker holds with its role."""
    from django.db import connection

    with tempfile.TemporaryDirectory() as data:
        env = {**os.environ, "DATABASE_URL": joined["database_url"], "REDIS_URL": joined["redis_url"],
               "GANTRY_HOST_NAME": HOST, "GANTRY_JOINED_HOST": "1", "GANTRY_DATA_DIR": data,
               "GANTRY_HEARTBEAT_INTERVAL": "1"}  # fmt: skip
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        argv = [sys.executable, "-m", "workers.hostworker", HOST]
        worker = subprocess.Popen(argv, env=env, cwd=ROOT, start_new_session=True, **quiet)
        try:
            time.sleep(15)
            with connection.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE usename = %s", [role])
                return cursor.fetchone()[0]
        finally:
            os.killpg(worker.pid, 15)
            worker.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_database_argument(parser)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--samples", type=int, default=300, help="per operation, side and round")
    parser.add_argument("--side", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--deployment", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
        import django

        django.setup()
        print(json.dumps(_side(args.side, args.deployment)))
        return
    control_url = args.database_url
    setup_postgres(control_url)
    from hosts.models import HostCredential

    joined = _prepare()
    role = HostCredential.objects.get(host__name=HOST, revoked_at=None).database_role
    sides = {"host role": joined["database_url"], "control plane's role (floor)": control_url}
    times: dict[str, dict[str, list[float]]] = {side: {name: [] for name in OPERATIONS} for side in sides}
    for round_ in range(args.rounds):
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        for side in order:
            for name, values in _run_side(sides[side], args.samples, int(joined["deployment"])).items():
                times[side][name] += values
    print(f"host path, {args.rounds} rounds x {args.samples} per side, sides alternating (ms)")
    print(f"{'operation':<10} {'side':<30} {'n':>6} {'p50':>8} {'p99':>8}")
    host_side, floor_side = list(sides)
    for name in OPERATIONS:
        for side in sides:
            values = times[side][name]
            print(f"{name:<10} {side:<30} {len(values):>6} {percentile(values, 0.5):>8.2f} "
                  f"{percentile(values, 0.99):>8.2f}")  # fmt: skip
        ours, floor = times[host_side][name], times[floor_side][name]
        print(f"{'':<10} {'ratio host/floor':<30} {'':>6} {percentile(ours, 0.5) / percentile(floor, 0.5):>8.2f} "
              f"{percentile(ours, 0.99) / percentile(floor, 0.99):>8.2f}")  # fmt: skip
    print(f"database connections held by one idle host worker (role {role}): {_connections(joined, role)}")


if __name__ == "__main__":
    main()
