"""Streamed generation, measured the same way by every LLM benchmark: closed-loop
clients (each stream sends a request as soon as its last one ended) against
Triton's generate_stream or an OpenAI-compatible /v1, and the floor they are
compared with, plain transformers generate in the benchmark's own process."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import P99_SAMPLES, in_turn, percentile, tail_percentile


@dataclass
class Target:
    """Where requests go: ``body(i)`` is the i-th request's JSON; ``openai`` says the
    answer is /v1's chat or completion chunks (else Triton's generate_stream events)."""

    url: str
    body: Callable[[int], dict]
    headers: dict = field(default_factory=dict)
    openai: bool = False


async def _one(session: Any, target: Target, i: int) -> dict | None:
    started = time.perf_counter()
    first, last, tokens = None, 0.0, 0
    async with session.post(target.url, json=target.body(i), headers=target.headers) as response:
        if response.status != 200:
            raise RuntimeError(f"{target.url}: {response.status} {await response.text()}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"{target.url}: {event['error']}")
            if target.openai:  # a chat chunk's delta, or a completion chunk's text; usage last
                choice = event["choices"][0] if event.get("choices") else {}
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
            else:
                text = event.get("text_output")
                tokens += int(event.get("num_output_tokens", 0))
            if text:
                last = time.perf_counter()
                first = first or last
    ended = time.perf_counter()
    if first is None:
        return None
    return {"ttft_ms": (first - started) * 1000, "tokens": tokens, "decode_s": ended - first, "ended": ended,
            "busy_s": ended - started, "tail_ms": (ended - last) * 1000}  # fmt: skip


def closed_loop(
    target: Target | list[Target], streams: int, seconds: float, min_samples: int = 0, think_ms: float = 0.0
) -> tuple[list[dict], float]:
    """``streams`` clients, each sending requests one after another: at least one
    each, then until ``seconds`` have passed and ``min_samples`` requests ended.
    Given several targets, the i-th request goes to target i % len(targets) (its
    sample's "side"), so the sides share the same moments and the same load.
    With ``think_ms``, a client pauses before each request after its first, the
    k-th request of each side pausing the same (spread evenly over 0 to think_ms),
    so that arrivals are not timed by the decoder's steps. Returns the samples and
    the wall time from the start to the last answer."""
    import aiohttp

    targets = target if isinstance(target, list) else [target]

    async def run() -> tuple[list[dict], float]:
        samples: list[dict] = []
        counter = iter(range(10**9))
        started = time.perf_counter()

        async def client(session: Any) -> None:
            first = True
            while True:
                i = next(counter)
                side, k = i % len(targets), i // len(targets)
                if think_ms and not first:
                    await asyncio.sleep(think_ms / 1000 * ((k * 0.6180339887) % 1.0))
                first = False
                sample = await _one(session, targets[side], k)
                if sample:
                    samples.append({**sample, "side": side})
                if time.perf_counter() >= started + seconds and len(samples) >= min_samples:
                    return

        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            await asyncio.gather(*(client(session) for _ in range(streams)))
        return samples, (max(s["ended"] for s in samples) - started) if samples else seconds

    return asyncio.run(run())


def figures(samples: list[dict], wall: float) -> dict:
    """Output tokens/s in all and per stream (median), and time to first token
    p50/p90, and p99 from 1000 samples up (None below)."""
    ttfts = [s["ttft_ms"] for s in samples]
    tails = [s["tail_ms"] for s in samples if "tail_ms" in s]
    rates = [(s["tokens"] - 1) / s["decode_s"] for s in samples if s["tokens"] > 1 and s["decode_s"] > 0]
    busy = sum(s.get("busy_s", 0.0) for s in samples)
    p99 = tail_percentile(ttfts, 0.99)
    return {
        "samples": len(samples),
        "tokens_per_s": round(sum(s["tokens"] for s in samples) / wall, 1),
        # Tokens per second of a stream's time spent on a request: a closed loop's tokens/s
        # over its streams, whether or not another side shared them.
        "stream_tokens_per_s": round(sum(s["tokens"] for s in samples) / busy, 1) if busy else None,
        "per_stream_tokens_per_s": round(statistics.median(rates), 1) if rates else None,
        "ttft_p50_ms": round(percentile(ttfts, 0.5), 2),
        "ttft_p90_ms": round(percentile(ttfts, 0.9), 2),
        "ttft_p99_ms": round(p99, 2) if p99 is not None else None,
        # From the last text to the stream's end: what a side adds after the last token.
        "tail_p50_ms": round(percentile(tails, 0.5), 3) if tails else None,
    }


def rotated(
    run: Callable[[str, int, float], tuple[list[dict], float]], sides: list[str], level: int, rounds: int,
    seconds: float,
) -> dict[str, dict]:  # fmt: skip
    """``run(side, level, seconds)`` for every side, ``rounds`` times, the order of the
    sides rotating every round: each side's figures over all its rounds."""
    collected = {side: {"samples": [], "wall": 0.0} for side in sides}
    for round_ in range(rounds):
        for side in in_turn(sides, round_):
            samples, wall = run(side, level, seconds)
            collected[side]["samples"] += samples
            collected[side]["wall"] += wall
    return {side: figures(value["samples"], value["wall"]) for side, value in collected.items()}


def p99_text(value: float | None, width: int = 8) -> str:
    return f"{value:{width}.1f}" if value is not None else f"{f'n<{P99_SAMPLES}':>{width}}"


class Floor:
    """A checkpoint in this process under plain transformers generate: batches of
    as many prompts as there are streams, min_new_tokens = max_new_tokens."""

    def __init__(self, checkpoint: Path, device: str, dtype: Any) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch, self.device = torch, device
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()

    def sync(self) -> None:
        if self.device != "cpu":
            self.torch.cuda.synchronize()

    def processor(self, streams: int) -> Any:
        """A LogitsProcessor of the floor's own for one batch of ``streams`` prompts, run
        after the first token's timing (None: plain generate)."""
        return None

    def closed_loop(self, prompts: list[str], streams: int, seconds: float, tokens: int) -> tuple[list[dict], float]:
        """Batches of ``streams`` prompts, one after another, for ``seconds`` (at least one)."""
        from transformers import LogitsProcessor, LogitsProcessorList

        first: list[float] = []
        sync = self.sync

        class FirstStep(LogitsProcessor):
            """Notes when generate asks for the first token's scores (the prompts are prefilled)."""

            def __call__(self, input_ids, scores):  # noqa: ANN001, ANN204
                if not first:
                    sync()
                    first.append(time.perf_counter())
                return scores

        samples: list[dict] = []
        started = time.perf_counter()
        while not samples or time.perf_counter() < started + seconds:
            first.clear()
            batch = [prompts[(len(samples) + i) % len(prompts)] for i in range(streams)]
            inputs = self.tokenizer(batch, return_tensors="pt", padding=True, return_token_type_ids=False)
            begun = time.perf_counter()
            with self.torch.inference_mode():
                self.model.generate(
                    **inputs.to(self.device),
                    max_new_tokens=tokens,
                    min_new_tokens=tokens,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    logits_processor=LogitsProcessorList([FirstStep(), *filter(None, [self.processor(streams)])]),
                )
            sync()
            ended = time.perf_counter()
            sample = {"ttft_ms": (first[0] - begun) * 1000, "tokens": tokens, "decode_s": ended - first[0]}
            samples += [{**sample, "ended": ended}] * streams
        return samples, max(s["ended"] for s in samples) - started


def copy_rate(torch: Any, device: str) -> float:
    """Bytes per second a same-device copy moves (read plus write), best of 10."""
    size = 2**30 if device != "cpu" else 2**28
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(10):
        if device != "cpu":
            torch.cuda.synchronize()
        begun = time.perf_counter()
        target.copy_(source)
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - begun)
    return 2 * size / best


class Peer:
    """transformers' own continuous batching on the same checkpoint, in this process:
    one ContinuousBatchingManager (its paged cache; CUDA graphs on a GPU, captured
    by its warm-up) kept for the whole run, as its docs advise for serving; each
    stream a closed loop of streamed requests added to it. One thread routes the
    manager's results to their streams (its own per-request iterator re-queues
    every result that is not its own: no way to serve 32 streams)."""

    def __init__(self, checkpoint: Path, device: str, dtype: Any, streams: int, tokens: int) -> None:
        import queue
        import threading

        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="sdpa")
        model = model.to(device).eval()
        # eos -1: every request writes exactly ``tokens`` tokens, as the other sides do.
        generation = GenerationConfig(max_new_tokens=tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                      eos_token_id=-1, pad_token_id=self.tokenizer.pad_token_id or 0)  # fmt: skip
        batching = ContinuousBatchingConfig(max_requests_per_batch=streams, use_cuda_graph=device != "cpu" or None)
        # Not under inference_mode: the manager's thread updates the tensors its warm-up makes.
        self.manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=batching)
        self.manager.warmup()
        self.manager.start()
        self.queues: dict[str, Any] = {}
        self.lock, self.queue_kind = threading.Lock(), queue.SimpleQueue
        self.router = threading.Thread(target=self._route, daemon=True)
        self.router.start()
        self.settings = {"device": device, "attention": model.config._attn_implementation,
                         "cuda_graphs": str(batching.use_cuda_graph)}  # fmt: skip

    def _route(self) -> None:
        while self.manager.is_running():
            result = self.manager.get_result(timeout=0.1)
            if result is not None:
                with self.lock:
                    waiting = self.queues.get(result.request_id)
                if waiting is not None:
                    waiting.put(result)

    def stop(self) -> None:
        self.manager.stop(block=True, timeout=10)

    def closed_loop(self, prompts: list[str], streams: int, seconds: float, tokens: int) -> tuple[list[dict], float]:
        """``streams`` threads, each adding one streamed request after another for ``seconds`` (at least one)."""
        import itertools
        import queue
        import threading

        encoded = [self.tokenizer.encode(p) for p in prompts]
        counter, samples = itertools.count(), []
        started = time.perf_counter()

        def stream() -> None:
            while True:
                i = next(counter)
                mine = self.queue_kind()
                request_id = f"peer-{i}"
                with self.lock:
                    self.queues[request_id] = mine
                begun = time.perf_counter()
                self.manager.add_request(encoded[i % len(encoded)], request_id=request_id, max_new_tokens=tokens,
                                         streaming=True)  # fmt: skip
                first, made = None, 0
                while True:
                    try:
                        result = mine.get(timeout=1)
                    except queue.Empty:
                        if not self.manager.is_running():
                            raise RuntimeError("transformers' continuous batching stopped (its log says why)") from None
                        continue
                    first = first or time.perf_counter()
                    made = len(result.generated_tokens)
                    if result.is_finished():
                        break
                ended = time.perf_counter()
                with self.lock:
                    del self.queues[request_id]
                samples.append({"ttft_ms": (first - begun) * 1000, "tokens": made, "decode_s": ended - first,
                                "ended": ended, "busy_s": ended - begun})  # fmt: skip
                if ended >= started + seconds:
                    return

        threads = [threading.Thread(target=stream) for _ in range(streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return samples, max(s["ended"] for s in samples) - started
