"""The seeds' stack on one GPU, through Gantry itself, beside its floors.

The control plane runs as a user runs it (tests/gpu/control_plane.py: `manage.py
gantry_demo --no-stack`, SQLite, its own Redis); an LLM, a cross-encoder
reranker and an embedder with its own code (workers/untrained.py: a ~1.1B
Llama in 16 bits and two BERTs, UNTRAINED weights: their text means nothing,
their cost is real) are registered through the REST API and deployed at the
seeds' split of GPU 0 (LLM 0.80, reranker 0.10, embedder 0.05).

Every side runs closed-loop (bench/streams.py): each stream sends its next
streamed request as soon as the last one ended, for --seconds per side, level
and round; the order of the sides alternates every round.

1. The stack (issue 27), at each level of concurrent streams (1, 8, 32):
   - served: streamed chat completions through /v1 (the gateway, Triton, the
     transformers model), --tokens tokens each, with embed and rerank requests
     running beside them;
   - floor: the same checkpoint in this process, plain transformers generate on
     batches of that many prompts, the same dtype.
   It prints tokens/s in all and per stream and time to first token for both,
   served/floor (target >= 0.9), and embed and rerank requests/s alone and beside.
2. The gateway's own cost (issue 34), on this machine's cores: streamed
   completions of about --gateway-tokens tokens (the k-th request of each side
   asks the same number, from half to one and a half times it) through /v1
   against the same prompts sent to Triton's generate_stream of the same
   deployment, nothing beside them. The two sides run at once, request by
   request (the 2k-th request to /v1, the 2k+1-th to Triton), so both meet the
   same moments of the decoder and the same load, for 2 x --rounds x
   --gateway-round-s seconds and until each side has --gateway-samples answers
   per level: added time to first token p50/p99 (target: p99 under 2 ms), each
   with a 95% bootstrap interval (how far the difference moves by the luck of
   the samples alone: a p99 rests on its largest tenth of a percent, and on a
   tail both sides share), and the ratio of tokens per second of the streams'
   time (>= 0.97). With GANTRY_METRICS_TOKEN set, it also reads the web
   process's own TTFT histogram, to tell a tail that arises before the
   gateway's code (HTTP, the event loop) from one after it (Triton). With
   --gateway-think-ms, each client pauses before a request (the k-th request's
   pause the same on both sides): a client that sends the instant its last
   answer ended reaches the decoder just as it admits requests when it calls
   Triton directly, and a step later through any proxy, which the comparison
   would count as the gateway's cost (docs/performance.md).

    make bench-gpu BENCH_GPU_ARGS="--rounds 2 --out report.json"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import added_interval  # noqa: E402
from bench.streams import Floor, Target, closed_loop, figures, p99_text  # noqa: E402

# GANTRY_GPU_SUITE_REHEARSAL=1: the same run on a CPU host, with the tiny LLM (as the GPU suite rehearses).
REHEARSAL = os.environ.get("GANTRY_GPU_SUITE_REHEARSAL") == "1"
LLM_SEQ = 512 if REHEARSAL else 2048
SPLIT = {"llm": 0.80, "reranker": 0.10, "embedder": 0.05}
SENTENCES = [f"Sentence number {i} about GPUs, models and serving." for i in range(16)]
PROMPT = "Write about GPUs, models and serving: "


def deploy(plane, checkpoints: dict[str, Path]) -> tuple[int, str]:  # noqa: ANN001
    for name, kind, trust in (("llm", "llm", False), ("reranker", "reranker", False), ("embedder", "embedding", True)):
        model = plane.register(name, kind, checkpoints[name], trust=trust)
        assert model["inspection"] == "ready", model["inspection_message"]
    gpu = {} if REHEARSAL else {"instance_kind": "KIND_GPU", "gpu_ids": [0]}
    half = {} if REHEARSAL else {"dtype": "float16"}
    models = [
        {"model": "llm", "gpu_memory_fraction": SPLIT["llm"], "max_batch_size": 32, "max_seq_len": LLM_SEQ, **gpu},
        {
            "model": "reranker",
            "gpu_memory_fraction": SPLIT["reranker"],
            "max_batch_size": 64,
            "max_seq_len": 512,
            **half,
            **gpu,
        },
        {
            "model": "embedder",
            "gpu_memory_fraction": SPLIT["embedder"],
            "max_batch_size": 128,
            "max_seq_len": 512,
            **half,
            **gpu,
        },
    ]
    deployment = plane.ok(
        "POST", "/api/deployments/", 201, json={"name": "seeds", "host": plane.host, "models": models}
    )
    plane.ok("POST", f"/api/deployments/{deployment['id']}/start/", 202)
    ready = plane.wait_status(deployment["id"], {"ready", "failed"})
    assert ready["status"] == "ready", ready["status_message"]
    for alias in SPLIT:
        plane.ok(
            "POST",
            "/api/gateway/aliases/",
            201,
            json={"name": f"seed-{alias}", "deployment": deployment["id"], "model": alias},
        )
    key = plane.ok("POST", "/api/gateway/keys/", 201, json={"name": "bench", "all_aliases": True})["key"]
    return deployment["id"], key


def side_load(url: str, key: str, stop: threading.Event, counts: dict) -> list[threading.Thread]:
    import requests

    def fire(kind: str) -> None:
        session = requests.Session()
        headers = {"Authorization": f"Bearer {key}"}
        while not stop.is_set():
            if kind == "embed":
                body, path = {"model": "seed-embedder", "input": SENTENCES}, "/v1/embeddings"
            else:
                body, path = {"model": "seed-reranker", "query": "GPUs", "documents": SENTENCES[:8]}, "/v1/rerank"
            if session.post(f"{url}{path}", json=body, headers=headers, timeout=60).status_code == 200:
                counts[kind] += 1

    threads = [threading.Thread(target=fire, args=(kind,), daemon=True) for kind in ("embed", "rerank")]
    for thread in threads:
        thread.start()
    return threads


def _alternating(sides: dict, level: int, rounds: int, **kwargs) -> dict:
    """Each side's figures at ``level`` streams over ``rounds`` rounds, in alternating order.
    ``sides``: name -> callable(level, **kwargs) returning (samples, wall)."""
    collected = {name: {"samples": [], "wall": 0.0} for name in sides}
    names = list(sides)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            samples, wall = sides[name](level, **kwargs)
            collected[name]["samples"] += samples
            collected[name]["wall"] += wall
    shown = {}
    for name, value in collected.items():
        ttfts = [round(sample["ttft_ms"], 2) for sample in value["samples"]]
        shown[name] = {**figures(value["samples"], value["wall"]), "ttft_ms": ttfts}
    return shown


def gateway_ttft_buckets(url: str) -> dict[float, float] | None:
    """The gateway's own time-to-first-token histogram (cumulative counts by upper bound,
    seconds, from each request's arrival in the web process), while GANTRY_METRICS_TOKEN
    is set for the control plane; None otherwise."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    token = os.environ.get("GANTRY_METRICS_TOKEN")
    if not token:
        return None
    text = requests.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10).text
    counts: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "gantry_time_to_first_token_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket") and sample.labels.get("door") == "gateway":
                    bound = float(sample.labels["le"])
                    counts[bound] = counts.get(bound, 0.0) + sample.value
    return counts


def main() -> int:
    import torch

    from tests.gpu import control_plane
    from tests.gpu.control_plane import TOKENIZER
    from workers.untrained import make_untrained_encoder, make_untrained_llm

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gantry-gpu-bench"))
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0, help="per side, level and round (the stack)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--gateway-tokens", type=int, default=16)
    parser.add_argument("--gateway-samples", type=int, default=1000, help="answers per side and level, at least")
    parser.add_argument(
        "--gateway-round-s", type=float, default=10.0, help="seconds per side and round, at least (both run at once)"
    )
    parser.add_argument(
        "--gateway-think-ms", type=float, default=0.0,
        help="each client's pause before a request, spread over 0 to this, the same on both sides",
    )  # fmt: skip
    parser.add_argument("--phases", default="stack,gateway")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    phases = args.phases.split(",")
    models = args.work / "models"
    size = "tiny" if REHEARSAL else "1b"
    made = time.monotonic()
    checkpoints = {
        "llm": make_untrained_llm(models / f"llm-{size}", size=size, tokenizer_dir=TOKENIZER),
        "reranker": make_untrained_encoder(models / "reranker", kind="reranker", tokenizer_dir=TOKENIZER),
        "embedder": make_untrained_encoder(
            models / "embedder", kind="embedding", remote_code=True, tokenizer_dir=TOKENIZER
        ),
    }
    report: dict = {"making_checkpoints_s": round(time.monotonic() - made, 1), "stack": {}, "gateway": {}}
    plane = control_plane.start(args.work / "control-plane", model_roots=[models])
    try:
        started = time.monotonic()
        deployment_id, key = deploy(plane, checkpoints)
        report["launch_to_ready_s"] = round(time.monotonic() - started, 1)
        replica = plane.ok("GET", f"/api/deployments/{deployment_id}/")["replica_set"][0]
        triton = f"http://127.0.0.1:{replica['http_port']}"
        auth = {"Authorization": f"Bearer {key}"}
        prompts = [f"{PROMPT}{i}" for i in range(256)]
        chat = Target(
            f"{plane.url}/v1/chat/completions",
            lambda i: {
                "model": "seed-llm",
                "messages": [{"role": "user", "content": prompts[i % 256]}],
                "max_tokens": args.tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
                "temperature": 1.0,
            },
            auth,
            openai=True,
        )
        floor = None
        if "stack" in phases:
            if REHEARSAL:
                floor = Floor(checkpoints["llm"], "cpu", torch.float32)
            else:
                half = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
                floor = Floor(checkpoints["llm"], "cuda:0", half)
            for level in levels:  # warm-up (CUDA graphs, allocators), not measured
                closed_loop(chat, level, 0.0)
                floor.closed_loop(prompts, level, 0.0, 8)
            counts = {"embed": 0, "rerank": 0}
            stop = threading.Event()
            threads = side_load(plane.url, key, stop, counts)
            time.sleep(10)
            stop.set()
            for thread in threads:
                thread.join()
            report["side_alone_per_s"] = {k: round(v / 10, 1) for k, v in counts.items()}

        def served(level: int, beside: dict, clock: list) -> tuple[list[dict], float]:
            stop = threading.Event()
            threads = side_load(plane.url, key, stop, beside)
            samples, wall = closed_loop(chat, level, args.seconds)
            stop.set()
            for thread in threads:
                thread.join()
            clock[0] += wall
            return samples, wall

        def in_process(level: int, beside: dict, clock: list) -> tuple[list[dict], float]:
            return floor.closed_loop(prompts, level, args.seconds, args.tokens)

        for level in levels if "stack" in phases else []:
            beside, clock = {"embed": 0, "rerank": 0}, [0.0]
            row = _alternating({"served": served, "floor": in_process}, level, args.rounds, beside=beside, clock=clock)
            row["served_over_floor"] = round(row["served"]["tokens_per_s"] / row["floor"]["tokens_per_s"], 3)
            row["side_beside_per_s"] = {k: round(v / clock[0], 1) for k, v in beside.items()}
            report["stack"][level] = row
            print(json.dumps({"stack": {level: _brief(row)}}), flush=True)

        # The k-th request of either side asks the same number of tokens, from half to
        # one and a half times --gateway-tokens: with one length for all, streams that
        # start together end together and rejoin the decoder in lockstep, which the
        # gateway's own jitter breaks, and the comparison measured that, not the gateway.
        def body(k: int) -> dict:
            tokens = args.gateway_tokens // 2 + (k * 7919) % args.gateway_tokens
            return {"max_tokens": tokens, "stream": True, "temperature": 1.0}

        usage = {"model": "seed-llm", "stream_options": {"include_usage": True}}
        gateway = Target(
            f"{plane.url}/v1/completions", lambda k: {**body(k), **usage, "prompt": prompts[k % 256]}, auth, openai=True
        )
        direct = Target(
            f"{triton}/v2/models/llm/generate_stream", lambda k: {**body(k), "text_input": prompts[k % 256]}
        )
        for level in levels if "gateway" in phases else []:
            # Every web process answers a burst first: a process that served nothing for a
            # minute reads its key and route again, which is not what this measures.
            closed_loop(gateway, 32, 0.0, 256)
            closed_loop(direct, 32, 0.0, 256)
            before = gateway_ttft_buckets(plane.url)
            # Both sides at once, request by request (the 2k-th to /v1, the 2k+1-th the same
            # body to Triton): each sees the same moments of the decoder and the same load.
            samples, wall = closed_loop(
                [gateway, direct], level, 2 * args.rounds * args.gateway_round_s, 2 * (args.gateway_samples + level),
                args.gateway_think_ms,
            )  # fmt: skip
            row = {}
            for side, name in enumerate(("gateway", "triton")):
                mine = [sample for sample in samples if sample["side"] == side]
                row[name] = {**figures(mine, wall), "ttft_ms": [round(sample["ttft_ms"], 2) for sample in mine]}
            if before is not None:  # where the gateway's tail arises: in the web process's view, or before it
                after = gateway_ttft_buckets(plane.url) or {}
                seen = {bound: after.get(bound, 0.0) - before.get(bound, 0.0) for bound in after}
                total = seen.get(math.inf) or 1.0
                client = row["gateway"]["ttft_ms"]
                row["gateway_seen_share_over"] = {
                    f"{bound * 1000:g}ms": {
                        "web_process": round(1 - seen[bound] / total, 4),
                        "client": round(sum(t > bound * 1000 for t in client) / len(client), 4),
                    }
                    for bound in sorted(seen)
                    if 0.01 <= bound <= 0.1
                }
            ours, floor = row["gateway"]["ttft_ms"], row["triton"]["ttft_ms"]
            row["added_ttft_p50_ms"] = round(row["gateway"]["ttft_p50_ms"] - row["triton"]["ttft_p50_ms"], 2)
            row["added_ttft_p50_interval_ms"] = [round(x, 2) for x in added_interval(ours, floor, 0.5)]
            if row["gateway"]["ttft_p99_ms"] is not None and row["triton"]["ttft_p99_ms"] is not None:
                row["added_ttft_p99_ms"] = round(row["gateway"]["ttft_p99_ms"] - row["triton"]["ttft_p99_ms"], 2)
                row["added_ttft_p99_interval_ms"] = [round(x, 2) for x in added_interval(ours, floor, 0.99)]
            # Each side's tokens per second of its streams' time: the two shared the streams.
            rates = row["gateway"]["stream_tokens_per_s"], row["triton"]["stream_tokens_per_s"]
            row["tokens_per_s_ratio"] = round(rates[0] / rates[1], 3)
            report["gateway"][level] = row
            print(json.dumps({"gateway": {level: _brief(row)}}), flush=True)
    finally:
        plane.stop()
    _print(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


def _brief(row: dict) -> dict:
    """A level's figures without the samples' times (those go to --out)."""
    return {k: {n: v for n, v in side.items() if n != "ttft_ms"} if isinstance(side, dict) else side
            for k, side in row.items()}  # fmt: skip


def _print(report: dict) -> None:
    if report["stack"]:
        alone = report["side_alone_per_s"]
        print(
            f"\nthe stack: served (/v1, embed and rerank beside) against plain generate in-process; "
            f"target served/floor >= 0.9; embed, rerank req/s alone {alone['embed']}, {alone['rerank']}"
        )
        print(
            f"{'streams':>7} {'side':>7} {'tok/s':>9} {'per stream':>10} {'TTFT p50':>9} {'p90':>8} {'p99':>8} "
            f"{'n':>6}  served/floor  embed, rerank beside"
        )
        for level, row in report["stack"].items():
            for side in ("served", "floor"):
                f = row[side]
                tail = (
                    f"  {row['served_over_floor']:>11}x  {row['side_beside_per_s']['embed']}, "
                    f"{row['side_beside_per_s']['rerank']}"
                    if side == "served"
                    else ""
                )
                print(
                    f"{level:>7} {side:>7} {f['tokens_per_s']:9.1f} {f['per_stream_tokens_per_s'] or 0:10.1f} "
                    f"{f['ttft_p50_ms']:9.1f} {f['ttft_p90_ms']:8.1f} {p99_text(f['ttft_p99_ms'])} "
                    f"{f['samples']:6d}{tail}"
                )
    if report["gateway"]:
        print("\nthe gateway's cost: /v1/completions against Triton's generate_stream, same prompts, both at once")
        print(
            f"{'streams':>7} {'side':>7} {'stream tok/s':>12} {'TTFT p50':>9} {'p99':>8} {'n':>6}  "
            f"added TTFT p50 [95%], p99 [95%] (target p99 < 2 ms)  tok/s ratio (>= 0.97)"
        )
        for level, row in report["gateway"].items():
            for side in ("gateway", "triton"):
                f = row[side]
                tail = ""
                if side == "gateway":
                    p50 = f"{row['added_ttft_p50_ms']:+.2f} {_interval(row['added_ttft_p50_interval_ms'])}"
                    p99 = (
                        f"{row['added_ttft_p99_ms']:+.2f} {_interval(row['added_ttft_p99_interval_ms'])}"
                        if "added_ttft_p99_ms" in row
                        else "n<1000"
                    )
                    tail = f"  {p50}, {p99} ms{'':>6}{row['tokens_per_s_ratio']}x"
                print(
                    f"{level:>7} {side:>7} {f['stream_tokens_per_s'] or 0:12.1f} {f['ttft_p50_ms']:9.2f} "
                    f"{p99_text(f['ttft_p99_ms'])} {f['samples']:6d}{tail}"
                )


def _interval(bounds: list[float]) -> str:
    return f"[{bounds[0]:+.2f}, {bounds[1]:+.2f}]"


if __name__ == "__main__":
    sys.exit(main())
