"""Structured output's cost on the transformers LLM: the same streamed requests
with a JSON schema and without, through one tritonserver, and llguidance's own
way on plain transformers beside them.

One tritonserver (Gantry's repository writer and process runtime) serves the
untrained byte-level Llama (1b on a GPU) as Gantry's causal-LM model. Sides:
- schema: generate_stream with guided_decoding_guide_type json_schema and a
  schema no document of which ends within --tokens (an array of at least 256
  short strings), so both sides write exactly --tokens tokens;
- free: the same requests without it;
- reference: plain transformers generate in this process, batches of as many
  prompts as there are streams, masked by llguidance each step (its
  torch helpers, fill_next_token_bitmask_par and apply_token_bitmask_inplace,
  in a LogitsProcessor): the library's reference use.
Each level and round runs every side closed-loop for --seconds, the order
rotating each round. It prints output tokens/s and time to first token
p50/p90/p99 (p99 from 1000 samples up), and schema/free (target >= 0.9x).

    make bench-structured                                         # CPU, tiny
    make bench-structured BENCH_STRUCTURED_ARGS="--gpu --size 1b --levels 1,32"
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import setup_django  # noqa: E402
from bench.streams import Floor, Target, closed_loop, p99_text, rotated  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 256}},
    "required": ["items"],
    "additionalProperties": False,
}
SIDES = ("schema", "free", "reference")


def _launch(args, work: Path, checkpoint: Path, levels: list[int]):  # noqa: ANN001
    from triton_server.config import Batching, CausalLmSpec, Instances
    from triton_server.repository import write_repository
    from triton_server.server import LaunchSpec

    instances = Instances(count=1, kind="KIND_GPU", gpus=(0,)) if args.gpu else Instances(count=1, kind="KIND_CPU")
    spec = CausalLmSpec(
        name="llm", checkpoint_path=str(checkpoint), instances=instances, gpu_memory_fraction=args.fraction,
        batching=Batching(max_batch_size=max(levels)), max_num_sequences=max(levels), max_seq_len=args.max_seq_len,
    )  # fmt: skip
    repository = work / "repository"
    shutil.rmtree(repository, ignore_errors=True)
    write_repository(repository, [spec])
    return LaunchSpec(
        deployment_id=1, generation=1, repository=repository, models=["llm"], http_port=args.port,
        grpc_port=args.port + 1, metrics_port=args.port + 2, log_path=work / "tritonserver.log",
    )  # fmt: skip


class Reference(Floor):
    """Plain transformers generate (the floor's batches), each step's logits masked by
    llguidance for the batch with its own torch helpers."""

    def processor(self, streams: int):  # noqa: ANN201 - a transformers LogitsProcessor
        import llguidance
        import llguidance.hf
        import llguidance.torch
        from transformers import LogitsProcessor

        vocab = self.model.get_output_embeddings().weight.shape[0]
        if not hasattr(self, "grammar"):
            self.llg_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=vocab)
            self.grammar = llguidance.LLMatcher.grammar_from_json_schema(
                SCHEMA, defaults={"whitespace_flexible": False}
            )
            self.executor = llguidance.LLExecutor()
        tokenizer, grammar, executor = self.llg_tokenizer, self.grammar, self.executor
        mask = llguidance.torch.allocate_token_bitmask(streams, vocab)

        class Masked(LogitsProcessor):
            def __init__(self) -> None:
                self.matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(streams)]
                self.started = False

            def __call__(self, input_ids, scores):  # noqa: ANN001, ANN204
                if self.started:
                    for matcher, token in zip(self.matchers, input_ids[:, -1].tolist(), strict=True):
                        matcher.consume_token(token)
                self.started = True
                llguidance.torch.fill_next_token_bitmask_par(
                    executor, [(m, i) for i, m in enumerate(self.matchers)], mask
                )
                llguidance.torch.apply_token_bitmask_inplace(scores, mask.to(scores.device))
                return scores

        return Masked()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", help="the untrained Llama's size: tiny or 1b")
    parser.add_argument("--gpu", action="store_true", help="serve on GPU 0 (default: the CPU)")
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--levels", default="1,32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0, help="per side, level and round")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--port", type=int, default=18900, help="first of Triton's three ports")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    levels, sides = [int(level) for level in args.levels.split(",")], args.sides.split(",")

    work = setup_django(args.port + 10)
    import torch

    from triton_server.client import TritonClient
    from workers.runtimes.process import ProcessRuntime
    from workers.untrained import make_untrained_llm

    device = "cuda:0" if args.gpu else "cpu"
    dtype = (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16) if args.gpu else torch.float32
    tokenizer_dir = os.environ.get("GANTRY_GPU_SUITE_TOKENIZER")
    checkpoint = make_untrained_llm(
        work / f"llm-bpe-{args.size}", size=args.size, tokenizer="bpe",
        tokenizer_dir=Path(tokenizer_dir) if tokenizer_dir else None,
    )  # fmt: skip
    launch = _launch(args, work, checkpoint, levels)
    runtime = ProcessRuntime(work / "data")
    handle = runtime.start(launch)
    report: dict = {"checkpoint": checkpoint.name, "device": device, "tokens": args.tokens, "levels": {}}
    try:
        client = TritonClient(f"127.0.0.1:{args.port}")
        client.wait_until_ready(launch.models, timeout_s=600, keep_waiting=lambda: runtime.is_running(handle, launch))
        client.close()
        reference = Reference(checkpoint, device, dtype) if "reference" in sides else None
        prompts = [f"<|im_start|>user\nList {i} things as JSON.<|im_end|>\n<|im_start|>assistant\n" for i in range(256)]
        url = f"http://127.0.0.1:{args.port}/v2/models/llm/generate_stream"
        guide = {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(SCHEMA)}

        def run(side: str, level: int, seconds: float) -> tuple[list[dict], float]:
            if side == "reference":
                return reference.closed_loop(prompts, level, seconds, args.tokens)
            body = {
                "max_tokens": args.tokens,
                "stream": True,
                "temperature": 1.0,
                **(guide if side == "schema" else {}),
            }
            return closed_loop(Target(url, lambda i: {**body, "text_input": prompts[i % len(prompts)]}), level, seconds)

        for side in sides:  # warm every side (graphs, allocator, compiled kernels), not measured
            for level in levels:
                run(side, level, 0.0)
        for level in levels:
            report["levels"][level] = rotated(run, sides, level, args.rounds, args.seconds)
            print(json.dumps({level: report["levels"][level]}), flush=True)
    finally:
        runtime.stop(handle, launch)
    _print(report, sides)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


def _print(report: dict, sides: list[str]) -> None:
    print(f"\n{report['checkpoint']} on {report['device']}, {report['tokens']} tokens a request; "
          "target: schema/free >= 0.9x in tokens/s")  # fmt: skip
    print(f"{'streams':>7} {'side':>9} {'tok/s':>9} {'per stream':>10} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'n':>6}")
    for level, row in report["levels"].items():
        for side in sides:
            f = row[side]
            print(
                f"{level:>7} {side:>9} {f['tokens_per_s']:9.1f} {f['per_stream_tokens_per_s'] or 0:10.1f} "
                f"{f['ttft_p50_ms']:9.1f} {f['ttft_p90_ms']:8.1f} {p99_text(f['ttft_p99_ms'])} {f['samples']:6d}"
            )
        ratios = [f"{a}/{b} {row[a]['tokens_per_s'] / row[b]['tokens_per_s']:.2f}x"
                  for a, b in (("schema", "free"), ("schema", "reference")) if a in row and b in row]  # fmt: skip
        print(f"{'':>7} " + ", ".join(ratios))


if __name__ == "__main__":
    sys.exit(main())
