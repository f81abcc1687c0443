"""Benchmark: what the channel's mutual TLS adds, against plain HTTP to the same
Triton, in another network namespace. Run as root (the namespace); one run
prints:

- **added latency at 1 client.** A real tritonserver in a namespace of its
  own serves a python-backend identity model (so the model's own time stays
  out of the figure) on the namespace's address; the host's channel
  (workers.channel.serve, with certificates from an authority made for the
  run by common.pki) runs beside it. One client, Gantry's own Triton client
  (triton_server.client.infer_async, one pooled keep-alive connection),
  sends the same small request to Triton directly (plain HTTP, the floor)
  and through the channel, in alternating rounds; p50/p99 of each and the
  difference (target: p99 added under 1 ms).

    make bench-channel                 # or: python bench/channel.py --help
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import percentile  # noqa: E402

MODEL = "identity"
_MODEL_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
"""
_CONFIG = """name: "identity"
backend: "python"
max_batch_size: 0
input [{ name: "IN", data_type: TYPE_FP32, dims: [ 16 ] }]
output [{ name: "OUT", data_type: TYPE_FP32, dims: [ 16 ] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
"""


def _certificates(folder: Path, host_id: int) -> tuple[str, str, str]:
    """The host's files in ``folder`` (as workers.channel keeps them) and the web
    tier's key, certificate and trust, from an authority made for this run."""
    from datetime import timedelta

    from common import pki
    from workers.channel import install

    now = pki.utcnow()
    authority_key, authority = pki.new_authority(now)
    crl = pki.revocation_list(authority_key=authority_key, authority=authority, serials=[], number=1, now=now)
    trust = pki.cert_pem(authority) + pki.cert_pem(crl)
    made = {}
    for name, host in (("host", host_id), ("web", None)):
        key = pki.new_key()
        issued = pki.issue(authority_key=authority_key, authority=authority, now=now, lifetime=timedelta(hours=1),
                           public=pki.load_request(pki.request(key, name)), common=name, host_id=host)  # fmt: skip
        made[name] = (pki.key_pem(key), pki.cert_pem(issued))
    folder.mkdir(mode=0o700)
    install(folder, key=made["host"][0], certificate=made["host"][1], trust=trust)
    return made["web"][0], made["web"][1], trust


async def _compare(sides: dict, *, requests: int, rounds: int) -> dict[str, list[float]]:
    """Alternating rounds of each side (the order flips every round), after a warm-up."""
    import numpy as np

    from triton_server.client import close_session, infer_async

    inputs = {"IN": np.arange(16, dtype=np.float32)}
    results: dict[str, list[float]] = {name: [] for name in sides}

    async def one(url: str, channel) -> float:  # noqa: ANN001
        started = time.perf_counter()
        out = await infer_async(url, MODEL, inputs, channel)
        assert out["OUT"].shape == (16,)
        return (time.perf_counter() - started) * 1000

    for url, channel in sides.values():
        for _ in range(50):
            await one(url, channel)
    order = list(sides)
    for n in range(rounds):
        for name in order if n % 2 == 0 else reversed(order):
            url, channel = sides[name]
            results[name] += [await one(url, channel) for _ in range(requests)]
    await close_session()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=250, help="requests per side per round")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench/channel.py needs root: its Triton runs in a network namespace", file=sys.stderr)
        return 2
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("SECRET_KEY", "gantry-bench-channel")
    os.environ.setdefault("DATABASE_URL", "sqlite:///:memory:")
    import django

    django.setup()
    from common import pki
    from tests.integration.conftest import namespaces
    from triton_server.client import Channel
    from workers import processes
    from workers.runtimes import process

    started: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="gantry-bench-channel-") as folder, namespaces(1) as (namespace,):
        root, name, address = Path(folder), namespace.name, namespace.address
        try:
            model = root / "repository" / MODEL
            (model / "1").mkdir(parents=True)
            (model / "1" / "model.py").write_text(_MODEL_PY)
            (model / "config.pbtxt").write_text(_CONFIG)
            http_port, channel_port = 18000, 17443  # a fresh namespace: every port is free
            backends = process.prepare_backends(root)
            triton = [str(process.triton_binary()), f"--model-repository={root / 'repository'}",
                      f"--backend-directory={backends}", "--http-address=0.0.0.0", f"--http-port={http_port}",
                      "--allow-grpc=false", "--allow-metrics=false", "--exit-timeout-secs=2"]  # fmt: skip
            with open(root / "triton.log", "wb") as log:
                started.append(subprocess.Popen(["ip", "netns", "exec", name, *triton], stdout=log, stderr=log,
                                                env=process.server_environment()))  # fmt: skip
            key, certificate, trust = _certificates(root / "channel", host_id=1)
            with open(root / "channel.log", "wb") as log:
                (root / "channel" / "ports").write_text(f"{http_port}\n")
                channel_argv = [sys.executable, "-m", "workers.channel", address, str(channel_port)]
                env = processes.child_environment({"PYTHONPATH": str(ROOT)})
                started.append(subprocess.Popen(["ip", "netns", "exec", name, *channel_argv], stdout=log, stderr=log,
                                                cwd=root / "channel", env=env))  # fmt: skip
            context = pki.context(server=False, key=key, certificate=certificate, trust=trust)
            sides = {
                "plain": (f"{address}:{http_port}", None),
                "channel": (f"{address}:{channel_port}", Channel(pki.server_name(1, http_port), context)),
            }
            _wait_until_served(sides)
            results = asyncio.run(_compare(sides, requests=args.requests, rounds=args.rounds))
        finally:
            for child in started:
                child.terminate()
                try:
                    child.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    child.kill()
    plain, channel = results["plain"], results["channel"]
    print(f"\nThe channel's mutual TLS against plain HTTP to the same Triton in another namespace "
          f"(1 client, {len(plain)} requests a side, {os.cpu_count()} cores here)")  # fmt: skip
    print(f"{'side':<40}{'p50 ms':>10}{'p99 ms':>10}")
    for words, lat in (("Triton directly, plain HTTP (floor)", plain), ("through the channel (mTLS)", channel)):
        print(f"{words:<40}{percentile(lat, 0.5):>10.3f}{percentile(lat, 0.99):>10.3f}")
    added50 = percentile(channel, 0.5) - percentile(plain, 0.5)
    added99 = percentile(channel, 0.99) - percentile(plain, 0.99)
    print(f"added: p50 {added50:.3f} ms, p99 {added99:.3f} ms (target p99 < 1 ms); "
          f"p99 ratio {percentile(channel, 0.99) / percentile(plain, 0.99):.2f}")  # fmt: skip
    return 0


def _wait_until_served(sides: dict, timeout_s: float = 60) -> None:
    import numpy as np

    from triton_server.client import close_session, infer_async

    async def ready() -> bool:
        try:
            for url, channel in sides.values():
                await infer_async(url, MODEL, {"IN": np.zeros(16, dtype=np.float32)}, channel)
        except Exception:  # noqa: BLE001 - not up yet, whatever the reason
            return False
        finally:
            await close_session()
        return True

    deadline = time.monotonic() + timeout_s
    while not asyncio.run(ready()):
        if time.monotonic() > deadline:
            raise SystemExit("Triton or the channel did not answer within a minute")
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
