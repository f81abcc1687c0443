"""The live path (make bench-live): event delivery from the worker's publish
to websocket clients, through daphne and the Redis channel layer.

Each figure is printed beside its floor from the same run, on the same live
server and the same Redis: a minimal Channels consumer (accept, join, forward;
bench/floor/asgi.py) fed by a bare ``group_send`` from one long-lived loop.

- delivery latency (publish to receipt) for 10 and 100 clients at 20 events/s
  and 1000 clients at 1 event/s;
- the worker-side cost of one event (the publish call; and, for context, a
  whole ``events.record`` with its insert and commit) beside the old way,
  ``async_to_sync(group_send)`` per group;
- deliveries/s at saturation (100 clients, publishing as fast as one process
  can), what is lost, and how much of the loss the clients can see as gaps in
  the sequence numbers (the browser re-reads on a gap: unseen loss is the
  defect);
- the time to open 1000 sockets;
- after a Redis restart, the seconds until each of 100 clients that behave as
  the browser does (static/gantry.js: reconnect every 0.5-1 s, re-read over
  REST on open) shows what the database says.

Targets on 2 cores: p99 at most 1.5x the floor at every N; worker-side cost
under 2 ms p50; every client in sync within 2 s of Redis returning; no loss
the clients cannot see.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.api import _seed  # noqa: E402
from bench.harness import add_database_argument, percentile, server, setup_postgres  # noqa: E402

# As static/gantry.js reconnects.
RECONNECT_FIRST_S, RECONNECT_MAX_S, RECONNECT_JITTER_S = 0.5, 0.75, 0.25


class Redis:
    """A Redis of the benchmark's own, so it can be restarted."""

    def __init__(self, port: int) -> None:
        self.port, self.dir, self.process = port, Path(tempfile.mkdtemp(prefix="gantry-bench-redis-")), None

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen([*argv, "--dir", str(self.dir)], stdout=subprocess.DEVNULL)
        while not self.answers():
            time.sleep(0.05)

    def answers(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_connect_timeout=0.2, retry=None).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


class FloorPublisher:
    """A bare group_send from one long-lived event loop: the least a publisher can do."""

    def __init__(self) -> None:
        from channels.layers import get_channel_layer

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.layer = get_channel_layer()

    def publish(self, group: str, payload: dict) -> None:
        message = {"type": "floor.message", "text": json.dumps(payload)}
        asyncio.run_coroutine_threadsafe(self.layer.group_send(group, message), self.loop)


def _gantry_publish(group: str, payload: dict) -> None:
    from core.events import publish

    publish(group, payload)


async def _open(urls: list[str], headers: dict[str, str]) -> list:
    from websockets.asyncio.client import connect

    sockets = []
    for start in range(0, len(urls), 100):  # a hundred handshakes in flight at a time
        batch = urls[start : start + 100]
        sockets += await asyncio.gather(*(connect(u, additional_headers=headers, max_queue=None) for u in batch))
    return sockets


async def _deliver(url: str, headers: dict, publish, group: str, clients: int, rate: float, count: int) -> dict:  # noqa: ANN001
    """Publish ``count`` messages at ``rate`` (0: as fast as possible) to ``clients`` sockets."""
    sockets = await _open([url] * clients, headers)
    latencies: list[float] = []
    seqs: list[set[int]] = [set() for _ in sockets]
    hello: list[int] = [0] * len(sockets)
    last_receipt = [0.0]
    any_receipt = [time.time()]
    burst = count

    async def read(index: int, socket) -> None:  # noqa: ANN001
        async for raw in socket:
            message = json.loads(raw)
            if message.get("type") == "hello":
                hello[index] = message["seq"]
            elif "sent" in message:
                any_receipt[0] = time.time()
                latencies.append((time.time() - message["sent"]) * 1000)
                last_receipt[0] = time.time() if message["i"] < burst else last_receipt[0]
                if "seq" in message:
                    seqs[index].add(message["seq"])

    readers = [asyncio.create_task(read(i, s)) for i, s in enumerate(sockets)]
    await asyncio.sleep(0.5)

    started = time.time()

    def publisher() -> float:
        began = time.monotonic()
        for i in range(count):
            publish(group, {"type": "bench", "sent": time.time(), "i": i})
            if rate:
                time.sleep(max(0.0, began + (i + 1) / rate - time.monotonic()))
        return time.monotonic() - began

    async def drained(quiet_s: float = 1.5) -> None:
        while time.time() - any_receipt[0] < quiet_s:
            await asyncio.sleep(0.2)

    took = await asyncio.to_thread(publisher)
    await drained()
    if not rate:
        # One more message, as the group's next event would be: its number shows
        # each client what it lost at the end of the burst.
        publish(group, {"type": "bench", "sent": time.time(), "i": count})
        count += 1
        await asyncio.sleep(0.5)
        await drained()
    for socket in sockets:
        await socket.close()
    for reader in readers:
        reader.cancel()
    # Loss a client sees: numbers missing between its hello and the highest it received
    # (a loss after that shows with the next message the group gets).
    seen_gaps = sum(max(s) - hello[i] - len(s) for i, s in enumerate(seqs) if s)
    received = len(latencies)
    return {
        "latencies": latencies, "took": took, "sent": count * clients, "received": received, "gaps": seen_gaps,
        "window": max(1e-3, last_receipt[0] - started),
    }  # fmt: skip


def _latency_line(name: str, got: list[float], floor: list[float]) -> str:
    p50, p99 = percentile(got, 0.5), percentile(got, 0.99)
    f50, f99 = percentile(floor, 0.5), percentile(floor, 0.99)
    return (f"  {name:<34} p50 {p50:7.1f} ms  p99 {p99:7.1f} ms   floor p50 {f50:6.1f}  p99 {f99:6.1f}   "
            f"p99 {p99 / f99:4.2f}x floor")  # fmt: skip


def _worker_cost(deployment_id: int) -> None:
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer
    from django.db import transaction

    from core import events
    from deployments.models import Deployment

    deployment = Deployment.objects.select_related("host").get(pk=deployment_id)
    groups = [events.DASHBOARD_GROUP, events.deployment_group(deployment_id)]
    publish_ms, record_ms, floor_ms = [], [], []
    layer = get_channel_layer()
    for i in range(300):
        began = time.perf_counter()
        events.publish(groups, {"type": "bench", "i": i})
        publish_ms.append((time.perf_counter() - began) * 1000)
        began = time.perf_counter()
        with transaction.atomic():
            events.record(kind="bench.cost", source="bench", deployment=deployment, message=f"event {i}")
        record_ms.append((time.perf_counter() - began) * 1000)
        began = time.perf_counter()
        for group in groups:  # the old way: a new loop and connection per message and group
            async_to_sync(layer.group_send)(group, {"type": "gantry.message", "payload": {"i": i}})
        floor_ms.append((time.perf_counter() - began) * 1000)
        time.sleep(0.005)
    print("\nworker-side cost of one event (two groups, 300 events)")
    print(f"  publish() call                     p50 {percentile(publish_ms, 0.5):7.3f} ms  "
          f"p99 {percentile(publish_ms, 0.99):7.3f} ms   (target < 2 ms p50)")  # fmt: skip
    print(f"  events.record + insert + commit    p50 {percentile(record_ms, 0.5):7.3f} ms  "
          f"p99 {percentile(record_ms, 0.99):7.3f} ms")  # fmt: skip
    ratio = percentile(floor_ms, 0.5) / percentile(publish_ms, 0.5)
    print(f"  before: async_to_sync(group_send)  p50 {percentile(floor_ms, 0.5):7.3f} ms  "
          f"p99 {percentile(floor_ms, 0.99):7.3f} ms   ({ratio:.0f}x the publish call)")  # fmt: skip


async def _open_time(url: str, headers: dict[str, str], clients: int) -> float:
    began = time.monotonic()
    sockets = await _open([url] * clients, headers)
    took = time.monotonic() - began
    for socket in sockets:
        await socket.close()
    return took


async def _resync_after_restart(
    live: str, web: str, token: str, deployment_id: int, redis: Redis, clients: int
) -> list[float]:  # noqa: E501
    """Seconds from Redis answering again until each browser-like client has re-read the database's state."""
    from concurrent.futures import ThreadPoolExecutor

    import requests
    from asgiref.sync import sync_to_async
    from websockets.asyncio.client import connect

    from deployments.models import Deployment

    headers = {"Authorization": f"Bearer {token}", "Origin": web}
    shown: list[str] = [""] * clients
    synced_at: list[float | None] = [None] * clients
    wanted = {"message": None}
    back = {"at": None}
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(clients))
    sessions = [requests.Session() for _ in range(clients)]  # one browser each
    for session in sessions:
        session.headers.update(headers)

    def read_status(index: int) -> str:
        return sessions[index].get(f"{web}/api/deployments/{deployment_id}/", timeout=30).json()["status_message"]

    async def browser(index: int) -> None:
        delay = RECONNECT_FIRST_S
        while True:
            try:
                async with connect(f"{live}/ws/deployments/{deployment_id}/", additional_headers=headers) as socket:
                    delay = RECONNECT_FIRST_S
                    shown[index] = await asyncio.to_thread(read_status, index)
                    if shown[index] == wanted["message"] and synced_at[index] is None and back["at"]:
                        synced_at[index] = time.monotonic() - back["at"]
                    async for _ in socket:
                        pass
            except (OSError, Exception):  # noqa: BLE001 - a refused or dropped socket: try again, as the page does
                pass
            await asyncio.sleep(delay + random.random() * RECONNECT_JITTER_S)
            delay = min(delay * 2, RECONNECT_MAX_S)

    tasks = [asyncio.create_task(browser(i)) for i in range(clients)]
    await asyncio.sleep(3)
    redis.stop()
    wanted["message"] = f"changed while Redis was down ({time.time():.0f})"
    await sync_to_async(lambda: Deployment.objects.filter(pk=deployment_id).update(status_message=wanted["message"]))()
    await asyncio.sleep(3)
    redis.start()
    back["at"] = time.monotonic()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(s is None for s in synced_at):
        await asyncio.sleep(0.05)
    for task in tasks:
        task.cancel()
    for session in sessions:
        session.close()
    return [s if s is not None else float("inf") for s in synced_at]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_database_argument(parser)
    parser.add_argument("--port", type=int, default=18800, help="web server port (live: +1, Redis: +2)")
    parser.add_argument("--seconds", type=float, default=10, help="per latency run")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is needed (make bench-live installs it)")
    redis = Redis(args.port + 2)
    redis.start()
    os.environ["REDIS_URL"] = f"redis://127.0.0.1:{redis.port}/0"
    try:
        _run(args, redis)
    finally:
        if redis.process and redis.process.poll() is None:
            redis.stop()


def _run(args: argparse.Namespace, redis: Redis) -> None:
    setup_postgres(args.database_url)
    token, deployment_id = _seed()
    from controlplane.serving import web_argv
    from core import events

    web, live = args.port, args.port + 1
    web_url, live_url = f"http://127.0.0.1:{web}", f"ws://127.0.0.1:{live}"
    headers = {"Authorization": f"Bearer {token}", "Origin": web_url}
    group = events.deployment_group(deployment_id)
    gantry_url, floor_url = f"{live_url}/ws/deployments/{deployment_id}/", f"{live_url}/floor/ws/{group}/"
    floor = FloorPublisher()
    live_argv = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(live), "bench.floor.asgi:application"]
    print(f"live server: daphne + channels_redis on Redis {redis.port}; {os.cpu_count()} cores")
    with server(web_argv(sys.executable, bind="127.0.0.1", port=web), web), server(live_argv, live):
        print("\nevent latency, publish to receipt (floor: a minimal consumer fed by a bare group_send)")
        for clients, rate in ((10, 20.0), (100, 20.0), (1000, 1.0)):
            count = max(5, int(rate * args.seconds))
            got = asyncio.run(_deliver(gantry_url, headers, _gantry_publish, group, clients, rate, count))
            base = asyncio.run(_deliver(floor_url, {}, floor.publish, group, clients, rate, count))
            print(_latency_line(f"{clients} clients, {rate:.0f} events/s", got["latencies"], base["latencies"]))

        _worker_cost(deployment_id)

        print("\nsaturation: 100 clients, one process publishing 2000 events as fast as it can")
        for name, url, hdrs, publish in (
            ("Gantry", gantry_url, headers, _gantry_publish),
            ("floor", floor_url, {}, floor.publish),
        ):  # noqa: E501
            r = asyncio.run(_deliver(url, hdrs, publish, group, 100, 0, 2000))
            lost = r["sent"] - r["received"]
            seen = f"{r['gaps']} of them seen as gaps" if name == "Gantry" else "none can be seen (no numbers)"
            if name == "Gantry" and lost > r["gaps"]:
                seen += f", {lost - r['gaps']} after each client's last message (the next message shows them)"
            print(f"  {name:<8} {r['received'] / r['window']:9.0f} deliveries/s   lost {lost} of {r['sent']} "
                  f"({100 * lost / r['sent']:.1f}%), {seen}")  # fmt: skip

        print("\nopening 1000 sockets (100 handshakes in flight)")
        took = asyncio.run(_open_time(gantry_url, headers, 1000))
        base = asyncio.run(_open_time(floor_url, {}, 1000))
        print(f"  Gantry {took:6.2f} s   floor {base:6.2f} s   {took / base:4.2f}x")

        print("\nRedis restarted under 100 browser-like clients (the deployment changed while it was down)")
        synced = asyncio.run(_resync_after_restart(live_url, web_url, token, deployment_id, redis, 100))
        done = sum(s != float("inf") for s in synced)
        print(f"  back in sync after Redis returned: p50 {percentile(synced, 0.5):5.2f} s   "
              f"max {max(synced):5.2f} s   ({done} of 100)   target: all within 2 s")  # fmt: skip


if __name__ == "__main__":
    main()
