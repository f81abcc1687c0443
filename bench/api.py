"""The REST API at fleet scale (make bench-api).

With 10 000 builds and 100 000 events in PostgreSQL, wrk's 16 connections
read 50-row pages of the heaviest lists from the web server as make demo runs
it (gunicorn + uvicorn workers); then websocket clients measure event
delivery from the live server, idle and while one client loops the heaviest
list. Each figure is printed beside its floor from the same run:

- a list page beside a plain Django view returning the same 50 rows (one
  query, values(), JsonResponse) on the same web server;
- delivery under load beside the same delivery idle, and beside the old
  setup (one daphne serving pages and websockets) under the same load.

Targets on 2 cores: >= 400 requests/s with p99 < 100 ms for a 50-row page;
websocket p99 under load < 2x idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import add_database_argument, percentile, server, setup_postgres  # noqa: E402

BUILDS, EVENTS = 10_000, 100_000


def _seed() -> tuple[str, int]:
    """The rows (made once per database) and a token of an operator; the busiest deployment's id."""
    from django.contrib.auth.models import User
    from django.db import connection, transaction

    from access.services import token_create
    from core.models import Event
    from deployments.models import Deployment, EngineBuild, RegisteredModel
    from hosts.services import hosts

    host = hosts.host_heartbeat(name="bench-host", address="127.0.0.1", gpus=[])
    model, _ = RegisteredModel.objects.get_or_create(
        name="bench-llm", defaults={"kind": "llm", "path": "/bench", "host": host, "inspection": "ready"}
    )
    deployment, created = Deployment.objects.get_or_create(name="bench")
    if created:
        deployment.pinned_hosts.add(host)
    with transaction.atomic():
        have = EngineBuild.objects.count()
        EngineBuild.objects.bulk_create(
            EngineBuild(
                model=model, host=host, status="succeeded", spec={"max_batch_size": 8, "dtype": "float16"},
                cache_key=f"{i:064x}", builder_image="bench:1", trtllm_version="0.16.0",
                artifacts=[{"path": "rank0.engine", "size": 1 << 30, "sha256": "ab" * 32}],
            )
            for i in range(have, BUILDS)
        )  # fmt: skip
        have = Event.objects.count()
        Event.objects.bulk_create(
            Event(
                kind="deployment.status" if i % 2 else "build.phase", source="worker:bench-host",
                message=f"event {i}: a line of the kind the timeline holds", host=host,
                deployment=deployment if i % 5 == 0 else None, data={"i": i},
            )
            for i in range(have, EVENTS)
        )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")  # fresh statistics, as autovacuum would give a real database
    user = User.objects.filter(username="bench").first() or User.objects.create_superuser("bench", password="bench")
    return token_create(user=user, name="bench").secret, deployment.pk


def _wrk(url: str, token: str, seconds: int, connections: int) -> dict[str, float]:
    run = subprocess.run(
        ["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "--latency", "-H", f"Authorization: Bearer {token}", url],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    out = run.stdout

    def ms(label: str) -> float:
        value, unit = re.search(rf"^\s*{label}\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()
        return float(value) * {"us": 0.001, "ms": 1, "s": 1000}[unit]

    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
        "p50": ms("50%"),
        "p99": ms("99%"),
        "errors": float(errors.group(1)) if errors else 0.0,
    }


async def _deliveries(live: str, token: str, origin: str, clients: int, rate: float, seconds: float) -> list[float]:
    """Milliseconds from publish (the worker's own path) to each client's receipt."""
    from websockets.asyncio.client import connect

    from core.events import DASHBOARD_GROUP, publish

    headers = {"Authorization": f"Bearer {token}", "Origin": origin}
    sockets = [await connect(f"{live}/ws/dashboard/", additional_headers=headers) for _ in range(clients)]
    latencies: list[float] = []

    async def read(socket) -> None:  # noqa: ANN001
        async for raw in socket:
            message = json.loads(raw)
            if "sent" in message:
                latencies.append((time.time() - message["sent"]) * 1000)

    readers = [asyncio.create_task(read(s)) for s in sockets]

    def publisher() -> None:
        for _ in range(int(rate * seconds)):
            publish(DASHBOARD_GROUP, {"type": "bench", "sent": time.time()})
            time.sleep(1 / rate)

    await asyncio.to_thread(publisher)
    await asyncio.sleep(1)
    for socket in sockets:
        await socket.close()
    for reader in readers:
        reader.cancel()
    return latencies


@contextmanager
def _heavy_reader(url: str, token: str) -> Iterator[None]:
    """One client looping the heaviest list page (500 events) in its own process."""
    code = (
        "import requests, sys\n"
        "s = requests.Session(); s.headers['Authorization'] = 'Bearer ' + sys.argv[2]\n"
        "while True: s.get(sys.argv[1], timeout=60)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", code, url, token], stdout=subprocess.DEVNULL)
    time.sleep(1)
    try:
        yield
    finally:
        process.kill()
        process.wait()


def _line(name: str, figures: list[float], floor: list[float] | None = None) -> str:
    p50, p99 = percentile(figures, 0.5), percentile(figures, 0.99)
    text = f"  {name:<46} p50 {p50:7.1f} ms   p99 {p99:7.1f} ms   ({len(figures)} deliveries)"
    if floor:
        text += f"   p99 {p99 / percentile(floor, 0.99):4.2f}x idle"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_database_argument(parser)
    parser.add_argument("--port", type=int, default=18700, help="web server port (live: +1, single daphne: +2)")
    parser.add_argument("--seconds", type=int, default=10, help="per wrk run")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--ws-clients", type=int, default=10)
    parser.add_argument("--ws-rate", type=float, default=20.0, help="events per second")
    args = parser.parse_args()

    setup_postgres(args.database_url)
    token, deployment = _seed()
    from controlplane.serving import live_argv, web_argv, web_workers

    web, live, single = args.port, args.port + 1, args.port + 2
    base = f"http://127.0.0.1:{web}"
    workers = web_workers()
    print(f"{BUILDS} builds, {EVENTS} events in PostgreSQL; wrk -c{args.connections} for {args.seconds}s each; "
          f"web: gunicorn, {workers} uvicorn workers; {os.cpu_count()} cores")  # fmt: skip
    # Each page beside two floors: five columns, and every field the page writes.
    pages = [
        ("GET /api/builds/?limit=50", "/api/builds/?limit=50", "builds"),
        ("GET /api/builds/?limit=50&status=succeeded", "/api/builds/?limit=50&status=succeeded", "builds"),
        ("GET /api/events/?limit=50", "/api/events/?limit=50", "events"),
        ("GET /api/deployments/<id>/events/?limit=50", f"/api/deployments/{deployment}/events/?limit=50", "events"),
        ("GET /api/events/?limit=50&kind=build.", "/api/events/?limit=50&kind=build.", "events"),
    ]  # fmt: skip
    with server(web_argv(sys.executable, bind="127.0.0.1", port=web), web):
        for path in ("/floor/builds/", pages[0][1]):  # warm every worker's code paths and pool
            _wrk(base + path, token, 3, args.connections)
        floors: dict[str, dict[str, float]] = {}
        print(f"\n{'list page (16 clients)':<48}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}   "
              "floor (5 columns) req/s, p99, ratio   floor (every field) req/s, p99, ratio")  # fmt: skip
        for name, path, table in pages:
            for floor_path in (f"/floor/{table}/", f"/floor/{table}-full/"):
                if floor_path not in floors:
                    floors[floor_path] = _wrk(base + floor_path, token, args.seconds, args.connections)
            got = _wrk(base + path, token, args.seconds, args.connections)
            both = [floors[f"/floor/{table}/"], floors[f"/floor/{table}-full/"]]
            beside = "   ".join(f"{f['rps']:7.0f}, {f['p99']:5.1f} ms, {got['rps'] / f['rps']:4.2f}x" for f in both)
            print(f"  {name:<46}{got['rps']:9.0f}{got['p50']:9.1f}{got['p99']:9.1f}   {beside}"
                  + (f"   ({got['errors']:.0f} errors)" if got["errors"] else ""))  # fmt: skip
        print("  targets: >= 400 req/s and p99 < 100 ms for a 50-row page")

        origin = base
        print(f"\nwebsocket delivery ({args.ws_clients} clients, {args.ws_rate:.0f} events/s, the worker's publish)")
        with server(live_argv(sys.executable, bind="127.0.0.1", port=live), live):
            live_url = f"ws://127.0.0.1:{live}"
            idle = asyncio.run(_deliveries(live_url, token, origin, args.ws_clients, args.ws_rate, args.seconds))
            print(_line("live server, idle", idle))
            with _heavy_reader(f"{base}/api/events/?limit=500", token):
                loaded = asyncio.run(_deliveries(live_url, token, origin, args.ws_clients, args.ws_rate, args.seconds))
            print(_line("live server, one client looping /api/events/?limit=500", loaded, idle))
    # The old setup: one daphne process for pages and websockets.
    single_argv = [
        sys.executable,
        "-m",
        "daphne",
        "-b",
        "127.0.0.1",
        "-p",
        str(single),
        "controlplane.asgi:application",
    ]
    with server(single_argv, single):
        url = f"ws://127.0.0.1:{single}"
        with _heavy_reader(f"http://127.0.0.1:{single}/api/events/?limit=500", token):
            before = asyncio.run(
                _deliveries(url, token, f"http://127.0.0.1:{single}", args.ws_clients, args.ws_rate, args.seconds)
            )
    print(_line("one daphne for both (before), same load", before, idle))
    print("  target: p99 under load < 2x idle")


if __name__ == "__main__":
    main()
