"""Three maintained grammar libraries on this decoder's tokenizer, side by side:
why gantry_grammar.py uses llguidance.

For each library and each JSON schema (a flat object, a nested one with arrays
and enums, an OpenAI tool call's arguments), on the byte-level tokenizer of the
demo's LLM (8192 tokens; --checkpoint for another):
- compile: from the schema to a matcher ready for its first mask (ms, median of
  --compiles; a new schema is a new request's, so this is on its first token);
- mask: one decode step's work for one constrained sequence, filling the
  token bitmask and then taking the sampled token (µs, p50/p99 over --steps
  steps of random walks: each step samples uniformly among the allowed
  tokens, as an untrained model does, and a finished document starts the next);
- valid: finished documents that json.loads parses and that hold every
  required key (a library that lets an invalid one through fails its purpose).

The order of the libraries rotates every round. llguidance comes with Gantry;
the others are installed by `make bench-grammars` beside it (xgrammar also
pulls in torch's triton).

    make bench-grammars
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import in_turn, percentile  # noqa: E402

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "score": {"type": "number"},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
            "author": {
                "type": "object",
                "properties": {"first": {"type": "string", "maxLength": 16}, "active": {"type": "boolean"}},
                "required": ["first", "active"],
                "additionalProperties": False,
            },
        },
        "required": ["title", "score", "tags", "author"],
        "additionalProperties": False,
    },
    "tool": {
        "type": "object",
        "properties": {
            "location": {"type": "string", "maxLength": 32},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        },
        "required": ["location", "unit", "days"],
        "additionalProperties": False,
    },
}


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.torch_ops = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.mask = llguidance.torch.allocate_token_bitmask(1, vocab)
        self.version = _version("llguidance")

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        return self.ll.LLMatcher(self.tokenizer, grammar)

    def allowed(self, matcher) -> list[int]:
        self.torch_ops.fill_next_token_bitmask(matcher, self.mask, 0)
        return _ids(self.mask[0])

    def take(self, matcher, token: int) -> bool:
        matcher.consume_token(token)
        return matcher.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, vocab)
        self.version = _version("xgrammar")

    def compile(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        return self.xgr.GrammarMatcher(compiled)

    def allowed(self, matcher) -> list[int]:
        matcher.fill_next_token_bitmask(self.mask, 0)
        return _ids(self.mask[0])

    def take(self, matcher, token: int) -> bool:
        matcher.accept_token(token)
        return matcher.is_terminated()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab: int) -> None:
        import outlines_core

        self.oc = outlines_core
        tokens: dict[bytes, list[int]] = {}
        for token, token_id in tokenizer.get_vocab().items():
            if token_id != tokenizer.eos_token_id:
                tokens.setdefault(tokenizer.convert_tokens_to_string([token]).encode(), []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, tokens)
        self.eos = tokenizer.eos_token_id
        self.version = _version("outlines-core")

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def allowed(self, matcher) -> list[int]:
        return list(matcher.get_tokens())

    def take(self, matcher, token: int) -> bool:
        if token == self.eos:
            return True
        matcher.advance(token)
        return matcher.is_finished() and list(matcher.get_tokens()) == [self.eos]


def _ids(row) -> list[int]:
    """The token ids a packed bitmask row (int32 words, bit i of word w = token 32w+i) allows."""
    import torch

    bits = (row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.nonzero(bits.reshape(-1)).reshape(-1).tolist()


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def run(library, schema_name: str, args, rng, tokenizer) -> dict:
    schema = SCHEMAS[schema_name]
    compiles = []
    for _ in range(args.compiles):
        start = time.perf_counter()
        matcher = library.compile(schema)
        compiles.append((time.perf_counter() - start) * 1000)
    steps, ids, documents, valid = [], [], 0, 0
    while len(steps) < args.steps:
        start = time.perf_counter()
        allowed = library.allowed(matcher)
        token = allowed[rng.randrange(len(allowed))]
        done = library.take(matcher, token)
        steps.append((time.perf_counter() - start) * 1e6)
        ids.append(token)
        if done:
            documents += 1
            text = tokenizer.decode(ids, skip_special_tokens=True)
            try:
                valid += set(schema["required"]) <= set(json.loads(text))
            except ValueError:
                pass
            ids, matcher = [], library.compile(schema)
    return {
        "compile_ms": statistics.median(compiles),
        "p50_us": percentile(steps, 0.5),
        "p99_us": percentile(steps, 0.99),
        "documents": documents,
        "valid": valid,
    }


def main() -> None:
    import random

    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint folder (default: the demo's LLM, made here)")
    parser.add_argument("--steps", type=int, default=2000, help="mask steps per library, schema and round")
    parser.add_argument("--compiles", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    checkpoint = args.checkpoint
    if checkpoint is None:
        from workers.untrained import make_untrained_llm

        checkpoint = make_untrained_llm(Path(tempfile.mkdtemp()) / "llm", tokenizer="bpe")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    libraries = []
    for kind in (Llguidance, Xgrammar, OutlinesCore):
        try:
            libraries.append(kind(tokenizer, vocab))
        except ImportError as exc:
            print(f"{kind.name}: not installed ({exc}); `make bench-grammars` installs it")
    results: dict[tuple[str, str], list[dict]] = {}
    for round_ in range(args.rounds):
        for library in in_turn(libraries, round_):
            for schema_name in SCHEMAS:
                figures = run(library, schema_name, args, random.Random(round_), tokenizer)
                results.setdefault((library.name, schema_name), []).append(figures)
    print(f"tokenizer: {checkpoint.name}, {vocab} tokens; {args.steps} steps x {args.rounds} rounds per cell")
    print(f"{'library':<24}{'schema':<8}{'compile ms':>12}{'mask p50 µs':>13}{'mask p99 µs':>13}{'valid':>12}")
    for library in libraries:
        for schema_name in SCHEMAS:
            runs = results[(library.name, schema_name)]
            documents = sum(r["documents"] for r in runs)
            valid = sum(r["valid"] for r in runs)
            print(
                f"{library.name + ' ' + library.version:<24}{schema_name:<8}"
                f"{statistics.median(r['compile_ms'] for r in runs):>12.2f}"
                f"{statistics.median(r['p50_us'] for r in runs):>13.1f}"
                f"{max(r['p99_us'] for r in runs):>13.1f}{f'{valid}/{documents}':>12}"
            )


if __name__ == "__main__":
    main()
