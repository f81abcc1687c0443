"""The seeds' stack on one GPU, through Gantry itself, beside its floor.

The control plane runs as a user runs it (tests/gpu/control_plane.py: `manage.py
gantry_demo --no-stack`, SQLite, its own Redis); an LLM, a cross-encoder
reranker and an embedder with its own code (workers/untrained.py: a ~1.1B
Llama in 16 bits and two BERTs, UNTRAINED weights: their text means nothing,
their cost is real) are registered through the REST API and deployed at the
seeds' split of GPU 0 (LLM 0.80, reranker 0.10, embedder 0.05).

For each level of concurrent streams (1, 8, 32) and each round, in turns:
- served: that many streamed chat completions through /v1 (the openai
  client's HTTP, the gateway, Triton, the transformers model), each asking
  --tokens tokens, with embed and rerank requests running beside them;
- floor: the same checkpoint in this process, plain transformers generate on a
  batch of that many prompts, the same dtype, min_new_tokens = max_new_tokens.
The order of the two alternates every round. It prints tokens/s in all,
tokens/s per stream and time to first token (p50 and p90, with the sample
count: no p99 is claimed under 1000 samples) for both, and served/floor; and
embed and rerank requests/s alone and beside each level.

    make bench-gpu BENCH_GPU_ARGS="--rounds 3 --out report.json"
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPLIT = {"llm": 0.80, "reranker": 0.10, "embedder": 0.05}
SENTENCES = [f"Sentence number {i} about GPUs, models and serving." for i in range(16)]
PROMPT = "Write about GPUs, models and serving: "


def quantile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2) if ordered else None


def deploy(plane, checkpoints: dict[str, Path]) -> tuple[int, str]:  # noqa: ANN001
    for name, kind, trust in (("llm", "llm", False), ("reranker", "reranker", False), ("embedder", "embedding", True)):
        model = plane.register(name, kind, checkpoints[name], trust=trust)
        assert model["inspection"] == "ready", model["inspection_message"]
    gpu = {"instance_kind": "KIND_GPU", "gpu_ids": [0]}
    models = [
        {"model": "llm", "gpu_memory_fraction": SPLIT["llm"], "max_batch_size": 32, "max_seq_len": 2048, **gpu},
        {
            "model": "reranker",
            "gpu_memory_fraction": SPLIT["reranker"],
            "max_batch_size": 64,
            "max_seq_len": 512,
            "dtype": "float16",
            **gpu,
        },
        {
            "model": "embedder",
            "gpu_memory_fraction": SPLIT["embedder"],
            "max_batch_size": 128,
            "max_seq_len": 512,
            "dtype": "float16",
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


def served(url: str, key: str, streams: int, tokens: int) -> list[dict]:
    """``streams`` streamed chat completions at once through /v1: per stream its TTFT, tokens and decode time."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600)
    samples: list[dict] = []

    def one(i: int) -> None:
        started = time.perf_counter()
        first = last = None
        count = 0
        stream = client.chat.completions.create(
            model="seed-llm",
            messages=[{"role": "user", "content": f"{PROMPT}{i}"}],
            max_tokens=tokens,
            stream=True,
            stream_options={"include_usage": True},
            temperature=1.0,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                last = time.perf_counter()
                first = first or last
            if chunk.usage:
                count = chunk.usage.completion_tokens
        samples.append({"ttft_ms": (first - started) * 1000, "tokens": count, "decode_s": last - first})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return samples


class Floor:
    """The same checkpoint in this process: plain transformers generate, batched."""

    def __init__(self, folder: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.tokenizer.padding_side = "left"
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to("cuda:0").eval()

    def run(self, streams: int, tokens: int) -> list[dict]:
        from transformers import LogitsProcessor, LogitsProcessorList

        torch = self.torch
        first: list[float] = []

        class FirstStep(LogitsProcessor):
            def __call__(self, input_ids, scores):  # noqa: ANN001, ANN204
                if not first:
                    torch.cuda.synchronize()
                    first.append(time.perf_counter())
                return scores

        prompts = [f"{PROMPT}{i}" for i in range(streams)]
        batch = self.tokenizer(prompts, return_tensors="pt", padding=True, return_token_type_ids=False).to("cuda:0")
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                **batch,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=True,
                logits_processor=LogitsProcessorList([FirstStep()]),
            )
        torch.cuda.synchronize()
        ended = time.perf_counter()
        return [{"ttft_ms": (first[0] - started) * 1000, "tokens": tokens, "decode_s": ended - first[0]}] * streams


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


def figures(samples: list[dict], wall_s: float) -> dict:
    ttfts = [s["ttft_ms"] for s in samples]
    per_stream = [(s["tokens"] - 1) / s["decode_s"] for s in samples if s["decode_s"] > 0 and s["tokens"] > 1]
    return {
        "samples": len(samples),
        "tokens_per_s": round(sum(s["tokens"] for s in samples) / wall_s, 1),
        "tokens_per_s_per_stream": round(statistics.median(per_stream), 1) if per_stream else None,
        "ttft_p50_ms": quantile(ttfts, 0.5),
        "ttft_p90_ms": quantile(ttfts, 0.9),
    }


def main() -> int:
    from tests.gpu import control_plane
    from tests.gpu.control_plane import TOKENIZER
    from workers.untrained import make_untrained_encoder, make_untrained_llm

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gantry-gpu-bench"))
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    models = args.work / "models"
    made = time.monotonic()
    checkpoints = {
        "llm": make_untrained_llm(models / "llm-1b", size="1b", tokenizer_dir=TOKENIZER),
        "reranker": make_untrained_encoder(models / "reranker", kind="reranker", tokenizer_dir=TOKENIZER),
        "embedder": make_untrained_encoder(
            models / "embedder", kind="embedding", remote_code=True, tokenizer_dir=TOKENIZER
        ),
    }
    report: dict = {"making_checkpoints_s": round(time.monotonic() - made, 1), "levels": {}}
    plane = control_plane.start(args.work / "control-plane", model_roots=[models])
    try:
        started = time.monotonic()
        _, key = deploy(plane, checkpoints)
        report["launch_to_ready_s"] = round(time.monotonic() - started, 1)
        floor = Floor(checkpoints["llm"])
        floor.run(1, 8)  # CUDA warm-up, not measured
        served(plane.url, key, 1, 8)
        counts = {"embed": 0, "rerank": 0}
        stop = threading.Event()
        threads = side_load(plane.url, key, stop, counts)
        time.sleep(10)
        stop.set()
        for thread in threads:
            thread.join()
        report["side_alone_per_s"] = {k: round(v / 10, 1) for k, v in counts.items()}
        for level in levels:
            sides: dict[str, dict] = {"served": {"samples": [], "wall": 0.0}, "floor": {"samples": [], "wall": 0.0}}
            beside = {"embed": 0, "rerank": 0}
            beside_s = 0.0
            for round_ in range(args.rounds):
                for side in ("served", "floor") if round_ % 2 == 0 else ("floor", "served"):
                    stop = threading.Event()
                    threads = side_load(plane.url, key, stop, beside) if side == "served" else []
                    begun = time.perf_counter()
                    samples = (
                        served(plane.url, key, level, args.tokens)
                        if side == "served"
                        else floor.run(level, args.tokens)
                    )
                    wall = time.perf_counter() - begun
                    stop.set()
                    for thread in threads:
                        thread.join()
                    beside_s += wall if side == "served" else 0.0
                    sides[side]["samples"] += samples
                    sides[side]["wall"] += wall
            row = {side: figures(value["samples"], value["wall"]) for side, value in sides.items()}
            row["served_over_floor"] = round(row["served"]["tokens_per_s"] / row["floor"]["tokens_per_s"], 3)
            row["side_beside_per_s"] = {k: round(v / beside_s, 1) for k, v in beside.items()}
            report["levels"][level] = row
            print(json.dumps({level: row}), flush=True)
    finally:
        plane.stop()
    print(
        f"\n{'streams':>7} | {'served tok/s':>12} | {'floor tok/s':>11} | {'served/floor':>12} (target >= 0.9) | "
        f"{'TTFT p50 served':>15} | {'TTFT p50 floor':>14} | embed, rerank req/s beside (alone "
        f"{report['side_alone_per_s']['embed']}, {report['side_alone_per_s']['rerank']})"
    )
    for level, row in report["levels"].items():
        print(
            f"{level:>7} | {row['served']['tokens_per_s']:>12} | {row['floor']['tokens_per_s']:>11} | "
            f"{row['served_over_floor']:>12}x{'':16} | {row['served']['ttft_p50_ms']:>13}ms | "
            f"{row['floor']['ttft_p50_ms']:>12}ms | {row['side_beside_per_s']['embed']}, "
            f"{row['side_beside_per_s']['rerank']}"
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
