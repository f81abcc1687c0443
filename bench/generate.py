"""Benchmark: text generation through Gantry's generate action against Triton's
own generate_stream on the same model, in the same run.

It sets up a one-machine Gantry (SQLite, the web server) and a real tritonserver
serving an LLM through the transformers path (the untrained tiny Llama by
default, or --checkpoint DIR), then alternates rounds of streamed requests
straight to Triton and through Gantry, and prints each figure beside its
floor: time to first token p50/p99, output tokens/s per stream, and the
batching gain (output tokens/s at N concurrent streams over one stream).

    make bench                                # or: python bench/generate.py --help
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import percentile, served, setup_django  # noqa: E402


@dataclass
class Sample:
    ttft_ms: float
    tokens: int
    decode_s: float  # from the first token to the last


@dataclass
class Figures:
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0

    def ttft(self, q: float) -> float:
        return percentile([s.ttft_ms for s in self.samples], q)

    def per_stream_tps(self) -> float:
        rates = [(s.tokens - 1) / s.decode_s for s in self.samples if s.tokens > 1 and s.decode_s > 0]
        return statistics.median(rates)

    def aggregate_tps(self) -> float:
        return sum(s.tokens for s in self.samples) / self.wall_s


async def _stream(session, url: str, body: dict, headers: dict, gantry: bool) -> Sample:  # noqa: ANN001
    started = time.perf_counter()
    first = last = None
    tokens = 0
    async with session.post(url, json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            added = event.get("tokens", 0) if gantry else event.get("num_output_tokens", 0)
            if added:
                now = time.perf_counter()
                first = first or now
                last = now
                tokens += added
    return Sample(ttft_ms=(first - started) * 1000, tokens=tokens, decode_s=(last - first) if last else 0.0)


async def _round(session, target: str, args, concurrency: int, requests: int) -> Figures:  # noqa: ANN001
    gantry = target == "gantry"
    url = args.gantry_url if gantry else args.triton_url
    headers = {"Authorization": f"Bearer {args.token}"} if gantry else {}
    figures = Figures()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            body = {"prompt" if gantry else "text_input": f"{args.prompt} {i}", "max_tokens": args.max_tokens,
                    "stream": True, "temperature": 1.0}  # fmt: skip
            figures.samples.append(await _stream(session, url, body, headers, gantry))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    figures.wall_s = time.perf_counter() - started
    return figures


async def _measure(args) -> dict:  # noqa: ANN001
    import aiohttp

    results: dict[tuple[str, int], Figures] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await _round(session, "triton", args, 2, 4)  # warm both paths
        await _round(session, "gantry", args, 2, 4)
        for _ in range(args.rounds):
            for concurrency in sorted({1, args.concurrency}):
                for target in ("triton", "gantry"):  # alternate, so drift hits both alike
                    figures = await _round(session, target, args, concurrency, args.requests * concurrency)
                    merged = results.setdefault((target, concurrency), Figures())
                    merged.samples += figures.samples
                    merged.wall_s += figures.wall_s
    return results


def _print(results: dict, concurrency: int) -> None:
    print(f"\n{'figure':44} {'Gantry':>10} {'Triton (floor)':>15} {'ratio':>7}")
    for c in sorted({1, concurrency}):
        g, t = results[("gantry", c)], results[("triton", c)]
        rows = [
            (f"time to first token p50 (ms), {c} stream(s)", g.ttft(0.5), t.ttft(0.5)),
            (f"time to first token p99 (ms), {c} stream(s)", g.ttft(0.99), t.ttft(0.99)),
            (f"output tokens/s per stream, {c} stream(s)", g.per_stream_tps(), t.per_stream_tps()),
            (f"output tokens/s all streams, {c} stream(s)", g.aggregate_tps(), t.aggregate_tps()),
        ]
        for name, ours, floor in rows:
            print(f"{name:44} {ours:10.2f} {floor:15.2f} {ours / floor:7.3f}")
        print(f"{'  added to TTFT p99 (ms)':44} {g.ttft(0.99) - t.ttft(0.99):10.2f}")
    one, many = results[("triton", 1)], results[("triton", concurrency)]
    print(
        f"\nbatching: {concurrency} concurrent streams give {many.aggregate_tps():.1f} output tokens/s, "
        f"one stream {one.aggregate_tps():.1f}: {many.aggregate_tps() / one.aggregate_tps():.2f}x "
        f"(target on an H100: at least 4x at 8 streams)"
    )
    print("targets: Gantry adds under 5 ms at p99 to time to first token and loses under 5% of tokens/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="a causal-LM folder (default: make the untrained tiny Llama)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=6, help="requests per stream per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompt", default="Benchmarks measure what users wait for:")
    parser.add_argument("--port", type=int, default=18600, help="first of the ports used (web, then Triton's three)")
    args = parser.parse_args()

    work = setup_django(args.port)
    from django.contrib.auth.models import User

    from access.services import token_create
    from deployments.services.placements import PlacementSpec
    from workers.untrained import make_untrained_llm

    checkpoint = args.checkpoint or make_untrained_llm(work / "tiny-llama")
    placement = PlacementSpec(model="llm", max_batch_size=max(8, args.concurrency), max_queue_delay_us=500)
    with served(port=args.port, models={"llm": (checkpoint, "llm")}, placements=[placement]) as stack:
        args.token = token_create(user=User.objects.create_user("bench"), name="bench").secret
        args.gantry_url = f"{stack.web}/api/deployments/{stack.deployment.pk}/generate/"
        args.triton_url = f"http://{stack.triton}/v2/models/llm/generate_stream"
        print(
            f"model: {checkpoint}; {args.rounds} rounds x {args.requests} requests per stream, "
            f"{args.max_tokens} tokens each, streamed; Triton {stack.triton}, Gantry (web server) {stack.web}"
        )
        _print(asyncio.run(_measure(args)), args.concurrency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
