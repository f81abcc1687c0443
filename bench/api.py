"""The REST API at fleet scale (make bench-api).

With 10 000 builds and 100 000 events in PostgreSQL, wrk's 16 connections
read 50-row pages of the builds and events lists, each side in turn (the
order rotates every round), from:

- pages: Gantry's pages server (gunicorn sync workers on one socket, WSGI, a
  kept connection per process: where production routes the REST API);
- web: Gantry's web server (gunicorn + uvicorn, Django in WSGI mode on a
  thread pool: what served the API before the pages server, and what the demo
  runs on its one port);
- floor: two plain gunicorn sync workers (as many as Gantry's processes)
  serving a Django view of the same 50 rows and columns (one query,
  values(), JsonResponse) with DATABASE_CONN_MAX_AGE=60.

Each round's p99 comes from every request of its run (thousands). Then
websocket clients measure event delivery from the live server, idle and while
one client loops the heaviest list, beside the old setup (one daphne serving
pages and websockets) under the same load.

Targets on 2 cores: pages/floor >= 0.9x in req/s with p99 <= 1.5x the
floor's; websocket p99 under load < 2x idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import add_database_argument, in_turn, percentile, server, setup_postgres  # noqa: E402

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
        "requests": float(re.search(r"(\d+) requests in", out).group(1)),
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
    parser.add_argument(
        "--port", type=int, default=18700, help="web server port (live +1, single daphne +2, pages +3, floor +4)"
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=int, default=8, help="per wrk run")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--ws-clients", type=int, default=10)
    parser.add_argument("--ws-rate", type=float, default=20.0, help="events per second")
    args = parser.parse_args()

    setup_postgres(args.database_url)
    token, deployment = _seed()
    from controlplane.serving import live_argv, pages_argv, web_argv, web_workers

    web, live, single, pages_port, floor_port = (args.port + i for i in range(5))
    base = f"http://127.0.0.1:{web}"
    workers = web_workers()
    print(f"{BUILDS} builds, {EVENTS} events in PostgreSQL; wrk -c{args.connections}, {args.rounds} rounds of "
          f"{args.seconds}s a side; {workers} processes a side; "
          f"{os.cpu_count()} cores")  # fmt: skip
    lists = [
        ("GET /api/builds/?limit=50", "/api/builds/?limit=50", "/floor/builds-full/"),
        ("GET /api/events/?limit=50", "/api/events/?limit=50", "/floor/events-full/"),
    ]  # fmt: skip
    floor_argv = [sys.executable, "-m", "gunicorn", "bench.floor.wsgi:application", "--workers", str(workers),
                  "--bind", f"127.0.0.1:{floor_port}", "--access-logfile", "/dev/null"]  # fmt: skip
    sides = {"pages": f"http://127.0.0.1:{pages_port}", "web": base, "floor": f"http://127.0.0.1:{floor_port}"}
    with (
        server(web_argv(sys.executable, bind="127.0.0.1", port=web), web),
        server(pages_argv(sys.executable, bind="127.0.0.1", port=pages_port), pages_port),
        server(floor_argv, floor_port, {"DATABASE_CONN_MAX_AGE": "60", "DATABASE_POOL_SIZE": "0"}),
    ):
        for name, path, floor_path in lists:
            print(f"\n{name} (16 clients){'':<8}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'requests':>10}")
            targets = {side: url + (floor_path if side == "floor" else path) for side, url in sides.items()}
            for target in targets.values():  # warm every process's code paths and connections
                _wrk(target, token, 2, args.connections)
            got: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
            for round_ in range(args.rounds):
                for side in in_turn(list(sides), round_):
                    figures = _wrk(targets[side], token, args.seconds, args.connections)
                    got[side].append(figures)
                    print(f"  round {round_ + 1} {side:<22}{figures['rps']:9.0f}{figures['p50']:9.1f}"
                          f"{figures['p99']:9.1f}{figures['requests']:10.0f}"
                          + (f"   ({figures['errors']:.0f} errors)" if figures["errors"] else ""))  # fmt: skip
            for side in ("pages", "web"):
                rps = statistics.median(g["rps"] / f["rps"] for g, f in zip(got[side], got["floor"], strict=True))
                p99 = statistics.median(g["p99"] / f["p99"] for g, f in zip(got[side], got["floor"], strict=True))
                print(f"  {side}/floor, median of {args.rounds} rounds: req/s {rps:4.2f}x, p99 {p99:4.2f}x")
        print("  targets: pages/floor >= 0.9x in req/s, p99 <= 1.5x the floor's")

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
