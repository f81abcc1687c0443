"""The causal-LM decoder against the loop it replaced and plain transformers, in one run.

One tritonserver (Gantry's repository writer and process runtime) serves the
same checkpoint twice:
- new: python_models/causal_lm_model.py with gantry_decode.py (slot KV cache,
  CUDA graphs on a GPU, sampling on the device, the next step queued before
  the host reads this one's tokens);
- old: bench/baselines/causal_lm_e88a8c0.py, the hand-written loop as it was
  at e88a8c0 (dynamic caches merged by re-padding, sampling row by row);
and this process runs it with plain transformers generate (floor): batches of
as many prompts as there are streams, min_new_tokens = max_new_tokens; and
with transformers' own continuous batching (peer: its ContinuousBatchingManager
with the paged cache and, on a GPU, its CUDA graphs, one request per stream
streamed, kept for the whole run; bench.streams.Peer).

For each level of concurrent streams and each round (the order of the three
sides rotates every round), each side runs closed-loop for --seconds: every
stream sends streamed generate_stream requests of --prompt-tokens prompt
tokens and --tokens output tokens at temperature 1, one after another. It
prints output tokens/s, per-stream tokens/s and time to first token p50/p90/p99
(p99 only from 1000 samples up), new/old and new/floor, and the memory-bandwidth
ceiling: the device's measured copy rate over the bytes one decode step must
read (the weights, plus each stream's KV cache).

--profile adds the torch profiler's view of the new decoder in this process
(the same Decoder, batch 1 and the largest level): wall time per step, device
time per step, and the operators that take it.

    make bench-decode                                   # CPU: the untrained tiny Llama
    make bench-decode BENCH_DECODE_ARGS="--gpu --size 1b --levels 1,8,32,64 --profile"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import setup_django  # noqa: E402
from bench.streams import Floor, Peer, Target, closed_loop, copy_rate, p99_text, rotated  # noqa: E402

BASELINE = Path(__file__).parent / "baselines" / "causal_lm_e88a8c0.py"
WORDS = "gpu model serving batch token cache graph stream latency memory kernel prompt".split()


def _prompt(tokenizer, tokens: int, seed: int) -> str:  # noqa: ANN001
    """A prompt of about ``tokens`` tokens, different for every request."""
    rng = random.Random(seed)
    text = str(seed)
    while len(tokenizer.encode(text)) < tokens:
        text += " " + " ".join(rng.choice(WORDS) for _ in range(8))
    return text


def _repository(args, work: Path, checkpoint: Path, levels: list[int]):  # noqa: ANN001
    from triton_server.config import Batching, CausalLmSpec, Instances, read_config, write_config
    from triton_server.repository import write_repository
    from triton_server.server import LaunchSpec

    instances = Instances(count=1, kind="KIND_GPU", gpus=(0,)) if args.gpu else Instances(count=1, kind="KIND_CPU")
    common = {
        "checkpoint_path": str(checkpoint),
        "instances": instances,
        "gpu_memory_fraction": args.fraction,
        "batching": Batching(max_batch_size=max(levels)),
        "max_num_sequences": max(levels),
        "max_seq_len": args.max_seq_len,
    }
    specs = [CausalLmSpec(name="new", **common), CausalLmSpec(name="old", **common)]
    repository = work / "repository"
    shutil.rmtree(repository, ignore_errors=True)
    write_repository(repository, specs)
    shutil.copyfile(BASELINE, repository / "old" / "1" / "model.py")
    config = read_config(repository / "old")
    config.parameters["max_batch_size"].string_value = str(max(levels))
    write_config(repository / "old", config)
    return LaunchSpec(
        deployment_id=1,
        generation=1,
        repository=repository,
        models=["new", "old"],
        http_port=args.port,
        grpc_port=args.port + 1,
        metrics_port=args.port + 2,
        log_path=work / "tritonserver.log",
    )


def _profile(args, floor: Floor, prompts: list[str], levels: list[int]) -> dict:  # noqa: ANN001
    """The new decoder in this process under the torch profiler: per step, wall and device time."""
    sys.path.insert(0, str(ROOT / "triton_server" / "python_models"))
    import gantry_decode
    from torch.profiler import ProfilerActivity, profile

    decoder = gantry_decode.Decoder(
        floor.model, max_batch=max(levels), max_len=args.max_seq_len, pad_id=floor.tokenizer.pad_token_id or 0
    )

    class Request:
        def __init__(self, text: str) -> None:
            self.prompt_ids = floor.tokenizer.encode(text)
            self.temperature, self.top_p, self.top_k, self.repetition_penalty, self.random = 1.0, 1.0, 0, 1.0, None

    report = {"mode": decoder.mode}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.gpu else [])
    for streams in sorted({1, max(levels)}):
        steps = min(args.tokens, args.max_seq_len - args.prompt_tokens - 8) - 1
        for measured in (False, True):  # the first pass captures the graphs
            decoder.admit([Request(prompts[i % len(prompts)]) for i in range(streams)])
            decoder.step()
            floor.sync()
            with profile(activities=activities) if measured else contextlib.nullcontext() as profiler:
                begun = time.perf_counter()
                for _ in range(steps):
                    decoder.step()
                floor.sync()
                wall = time.perf_counter() - begun
            decoder.release(list(decoder.rows))
        events = profiler.key_averages()
        device_us = sum(e.self_device_time_total for e in events) if args.gpu else 0
        table = events.table(sort_by="self_cuda_time_total" if args.gpu else "self_cpu_time_total", row_limit=12)
        report[streams] = {
            "wall_ms_per_step": round(wall * 1000 / steps, 3),
            "device_ms_per_step": round(device_us / 1000 / steps, 3),
            "table": table,
        }
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="a causal-LM folder (default: make an untrained Llama)")
    parser.add_argument("--size", default="tiny", help="the untrained Llama's size: tiny or 1b")
    parser.add_argument("--gpu", action="store_true", help="serve on GPU 0 (default: the CPU)")
    parser.add_argument("--fraction", type=float, default=0.3, help="each served model's share of the GPU")
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0, help="per side, level and round")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--sides", default="new,old,floor,peer")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--port", type=int, default=18800, help="first of Triton's three ports")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    sides = args.sides.split(",")

    work = setup_django(args.port + 10)
    import torch

    from triton_server.client import TritonClient
    from workers.runtimes.process import ProcessRuntime
    from workers.untrained import make_untrained_llm

    device = "cuda:0" if args.gpu else "cpu"
    dtype = (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16) if args.gpu else torch.float32
    tokenizer_dir = os.environ.get("GANTRY_GPU_SUITE_TOKENIZER")
    checkpoint = args.checkpoint or make_untrained_llm(
        work / f"llm-{args.size}", size=args.size, tokenizer_dir=Path(tokenizer_dir) if tokenizer_dir else None
    )
    launch = _repository(args, work, checkpoint, levels)
    runtime = ProcessRuntime(work / "data")
    handle = runtime.start(launch)
    report: dict = {"checkpoint": str(checkpoint), "device": device, "levels": {}}
    try:
        client = TritonClient(f"127.0.0.1:{args.port}")
        began = time.monotonic()
        client.wait_until_ready(launch.models, timeout_s=600, keep_waiting=lambda: runtime.is_running(handle, launch))
        client.close()
        report["load_s"] = round(time.monotonic() - began, 1)
        floor = Floor(checkpoint, device, dtype)
        prompts = [_prompt(floor.tokenizer, args.prompt_tokens, seed) for seed in range(256)]
        weights = sum(p.numel() * p.element_size() for p in floor.model.parameters())
        config = floor.model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
        rate = copy_rate(torch, device)
        report.update(weights_bytes=weights, kv_bytes_per_token=kv_per_token, copy_bytes_per_s=rate)

        peer = Peer(checkpoint, device, dtype, max(levels), args.tokens) if "peer" in sides else None
        report["peer"] = peer.settings if peer else None

        def run(side: str, level: int, seconds: float) -> tuple[list[dict], float]:
            if side == "floor":
                return floor.closed_loop(prompts, level, seconds, args.tokens)
            if side == "peer":
                return peer.closed_loop(prompts, level, seconds, args.tokens)
            url = f"http://127.0.0.1:{args.port}/v2/models/{side}/generate_stream"
            body = {"max_tokens": args.tokens, "stream": True, "temperature": 1.0}
            return closed_loop(Target(url, lambda i: {**body, "text_input": prompts[i % len(prompts)]}), level, seconds)

        for side in sides:  # warm every side (graphs, allocator), not measured
            for level in levels:
                run(side, level, 0.0)
        for level in levels:
            row = rotated(run, sides, level, args.rounds, args.seconds)
            context = args.prompt_tokens + args.tokens / 2
            row["ceiling_tokens_per_s"] = round(level * rate / (weights + level * context * kv_per_token), 1)
            report["levels"][level] = row
            print(json.dumps({level: row}), flush=True)
        if args.profile:
            report["profile"] = _profile(args, floor, prompts, levels)
        if peer:
            peer.stop()
    finally:
        runtime.stop(handle, launch)
    _print(report, sides)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    return 0


def _print(report: dict, sides: list[str]) -> None:
    print(
        f"\n{report['checkpoint']} on {report['device']}: weights {report['weights_bytes'] / 1e9:.2f} GB, "
        f"KV {report['kv_bytes_per_token'] / 1e3:.1f} kB/token, copy rate {report['copy_bytes_per_s'] / 1e9:.0f} GB/s; "
        f"targets: new/old >= 4x at 1 stream, >= 5x at 32; TTFT p50 at 32 streams < 100 ms; new/peer >= 1.5x at 32"
    )
    print(f"{'streams':>7} {'side':>6} {'tok/s':>9} {'per stream':>10} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'n':>6}")
    for level, row in report["levels"].items():
        for side in sides:
            f = row[side]
            print(
                f"{level:>7} {side:>6} {f['tokens_per_s']:9.1f} {f['per_stream_tokens_per_s'] or 0:10.1f} "
                f"{f['ttft_p50_ms']:9.1f} {f['ttft_p90_ms']:8.1f} {p99_text(f['ttft_p99_ms'])} {f['samples']:6d}"
            )
        ratios = [
            f"{side}/{other} {row[side]['tokens_per_s'] / row[other]['tokens_per_s']:.2f}x"
            for side, other in (("new", "old"), ("new", "floor"), ("new", "peer"))
            if side in row and other in row
        ]
        print(f"{'':>7} ceiling {row['ceiling_tokens_per_s']:.0f} tok/s; " + ", ".join(ratios))
    for streams, step in report.get("profile", {}).items():
        if streams == "mode":
            print(f"\nprofile of the new decoder in-process ({step})")
            continue
        print(
            f"\n{streams} stream(s): {step['wall_ms_per_step']} ms wall and "
            f"{step['device_ms_per_step']} ms on the device per step\n{step['table']}"
        )


if __name__ == "__main__":
    sys.exit(main())
