"""Gantry's one home for TensorRT-LLM command lines.

What each TensorRT-LLM release accepts is kept as data (``RELEASES``): the
flags of trtllm-build and of the checkpoint converters, where the per-model
example scripts live, and which flag turns the paged KV cache on. Command
lines are composed only from flags the chosen release has, and the tests pin
the table, so a build never fails on an unknown argument an hour in.

Sources: ``tensorrt_llm/commands/build.py`` (argument parser and
``add_plugin_argument``; for 0.16.0 checked against the upstream parser by
tests/unit/triton_server/test_upstream_trtllm.py, with tensorrtllm_backend's
config templates of 0.12.0 and 0.16.0), ``examples/*/convert_checkpoint.py`` and
``examples/quantization/quantize.py`` of each release tag; for trtllm-bench,
``tensorrt_llm/bench/benchmark/throughput.py`` (``bench/run/run.py`` before it
moved) and ``bench/dataclasses/reporting.py``, the report it writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Flags every release in the table shares.
_BUILD_COMMON = frozenset(
    {
        "--checkpoint_dir",
        "--output_dir",
        "--max_batch_size",
        "--max_input_len",
        "--max_seq_len",
        "--max_beam_width",
        "--max_num_tokens",
        "--gemm_plugin",
        "--gpt_attention_plugin",
        "--context_fmha",
        "--use_paged_context_fmha",
        "--remove_input_padding",
        "--input_timing_cache",
        "--output_timing_cache",
        "--workers",
        "--log_level",
    }
)
_CONVERT_COMMON = frozenset(
    {
        "--model_dir",
        "--output_dir",
        "--dtype",
        "--tp_size",
        "--pp_size",
        "--workers",
        "--use_weight_only",
        "--weight_only_precision",
    }
)
# trtllm-bench's own options (before the subcommand) and its throughput subcommand's.
_BENCH_GLOBAL = frozenset({"--model", "--workspace", "--log_level"})
_BENCH_EARLY = frozenset(
    {
        "--engine_dir",
        "--max_batch_size",
        "--max_num_tokens",
        "--beam_width",
        "--kv_cache_free_gpu_mem_fraction",
        "--dataset",
        "--num_requests",
    }
)
# What the throughput subcommand needs for Gantry to read a native ceiling from it:
# a concurrency to match the served step, and the JSON report the figures come from.
BENCH_NEEDS = ("--concurrency", "--report_json")
_QUANTIZE_COMMON = frozenset(
    {"--model_dir", "--output_dir", "--dtype", "--qformat", "--kv_cache_dtype", "--tp_size", "--pp_size"}
)

# Architecture (config.json "architectures"[0]) -> the example folder with its converter.
_MODELS_FLAT = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen",
    "GPT2LMHeadModel": "gpt",
    "GPTNeoXForCausalLM": "gptneox",
    "FalconForCausalLM": "falcon",
    "GemmaForCausalLM": "gemma",
    "Phi3ForCausalLM": "phi",
    "GPTJForCausalLM": "gptj",
}
# From 0.19 the examples are split into models/core and models/contrib.
_MODELS_SPLIT = {
    "LlamaForCausalLM": "models/core/llama",
    "MistralForCausalLM": "models/core/llama",
    "MixtralForCausalLM": "models/core/llama",
    "Qwen2ForCausalLM": "models/core/qwen",
    "GPT2LMHeadModel": "models/core/gpt",
    "GemmaForCausalLM": "models/core/gemma",
    "Phi3ForCausalLM": "models/core/phi",
    "GPTNeoXForCausalLM": "models/contrib/gptneox",
    "FalconForCausalLM": "models/contrib/falcon",
    "GPTJForCausalLM": "models/contrib/gptj",
}


# gpt-oss (20b, 120b): served by TensorRT-LLM's PyTorch backend only, never by an engine build.
GPT_OSS = "GptOssForCausalLM"


@dataclass(frozen=True)
class Release:
    """What one TensorRT-LLM release accepts."""

    version: str
    examples_dir: str  # inside the NGC Triton TRT-LLM image
    model_dirs: dict[str, str]
    build_flags: frozenset[str]
    convert_flags: frozenset[str]
    quantize_flags: frozenset[str]
    paged_kv_cache: tuple[str, str]  # the flag and value that select the paged KV cache
    bench_global_flags: frozenset[str]  # trtllm-bench's own options
    bench_flags: frozenset[str]  # its throughput subcommand's
    # tensorrtllm_backend's LLM-API model folder inside the image, where the
    # release serves a HuggingFace checkpoint with no engine build; "" if it cannot.
    llmapi_model_dir: str = ""
    # Architectures that release's LLM API (the PyTorch backend) serves from a
    # checkpoint, beyond those it has converters for (gpt-oss has no converter).
    llmapi_extra_architectures: frozenset[str] = frozenset()
    # The tensorrt_llm model's decoding_mode values its backend reads
    # (model_instance_state.cc); the speculative ones need engines Gantry does not build.
    decoding_modes: frozenset[str] = frozenset({"top_k", "top_p", "top_k_top_p", "beam_search"})
    # Its tensorrt_llm model takes num_return_sequences and answers each response's
    # sequence_index: several sequences of one prompt sampled in the engine's batch.
    num_return_sequences: bool = True

    @property
    def architectures(self) -> list[str]:
        return sorted(self.model_dirs)

    @property
    def llmapi_architectures(self) -> frozenset[str]:
        """What the LLM API of this release serves straight from a checkpoint (none without one)."""
        if not self.llmapi_model_dir:
            return frozenset()
        return frozenset(self.model_dirs) | self.llmapi_extra_architectures


RELEASES: dict[str, Release] = {
    release.version: release
    for release in (
        # Triton 24.08: --kv_cache_type does not exist yet.
        Release(
            version="0.12.0",
            examples_dir="/app/tensorrt_llm/examples",
            model_dirs=_MODELS_FLAT,
            build_flags=_BUILD_COMMON | {"--paged_kv_cache"},
            convert_flags=_CONVERT_COMMON,
            quantize_flags=_QUANTIZE_COMMON,
            paged_kv_cache=("--paged_kv_cache", "enable"),
            # trtllm-bench's first release: no concurrency, no report file (it logs a table).
            bench_global_flags=_BENCH_GLOBAL,
            bench_flags=_BENCH_EARLY,
            num_return_sequences=False,
        ),
        # Triton 24.12 (the seeds' image): --kv_cache_type, --paged_kv_cache deprecated.
        Release(
            version="0.16.0",
            examples_dir="/app/tensorrt_llm/examples",
            model_dirs=_MODELS_FLAT,
            build_flags=_BUILD_COMMON | {"--kv_cache_type", "--paged_kv_cache"},
            convert_flags=_CONVERT_COMMON,
            quantize_flags=_QUANTIZE_COMMON,
            paged_kv_cache=("--kv_cache_type", "paged"),
            # Streaming and a concurrency limit, still no report file.
            bench_global_flags=_BENCH_GLOBAL,
            bench_flags=_BENCH_EARLY | {"--streaming", "--iteration_log", "--concurrency"},
        ),
        # Triton 25.06: examples under models/core|contrib; the LLM-API backend serves checkpoints directly.
        Release(
            version="0.20.0",
            examples_dir="/app/tensorrt_llm/examples",
            model_dirs=_MODELS_SPLIT,
            build_flags=_BUILD_COMMON | {"--kv_cache_type"},
            convert_flags=_CONVERT_COMMON,
            quantize_flags=_QUANTIZE_COMMON,
            paged_kv_cache=("--kv_cache_type", "paged"),
            # The LLM-API benchmark: a checkpoint folder beside the model name, warm-up,
            # and a JSON report; an engine folder still selects the engine (C++) path.
            bench_global_flags=_BENCH_GLOBAL | {"--model_path"},
            bench_flags=_BENCH_EARLY
            | {"--streaming", "--iteration_log", "--concurrency", "--warmup", "--report_json", "--tp", "--pp"},
            llmapi_model_dir="/app/all_models/llmapi/tensorrt_llm",
        ),
        # Triton 25.09 and 25.10 (the compatibility matrix): the first release whose
        # PyTorch backend serves gpt-oss (MXFP4 MoE weights, bf16 activations on
        # Hopper). trtllm-build has no converter for it: it goes through the LLM API.
        # The flags and folders follow 0.20's; not checked in the image here.
        Release(
            version="1.0.0",
            examples_dir="/app/tensorrt_llm/examples",
            model_dirs=_MODELS_SPLIT,
            build_flags=_BUILD_COMMON | {"--kv_cache_type"},
            convert_flags=_CONVERT_COMMON,
            quantize_flags=_QUANTIZE_COMMON,
            paged_kv_cache=("--kv_cache_type", "paged"),
            bench_global_flags=_BENCH_GLOBAL | {"--model_path"},
            bench_flags=_BENCH_EARLY
            | {"--streaming", "--iteration_log", "--concurrency", "--warmup", "--report_json", "--tp", "--pp"},
            llmapi_model_dir="/app/all_models/llmapi/tensorrt_llm",
            llmapi_extra_architectures=frozenset({GPT_OSS}),
        ),
    )
}


def first_release_serving(architecture: str) -> Release | None:
    """The oldest release in the table whose LLM API serves ``architecture``."""
    able = [r for r in RELEASES.values() if architecture in r.llmapi_architectures]
    return min(able, key=lambda r: tuple(int(p) for p in r.version.split(".")), default=None)


DTYPES = ("float16", "bfloat16")
QUANTIZATIONS = ("none", "fp8", "int8_wo", "int4_wo")
PLUGIN_CHOICES = ("auto", "disable", "float16", "bfloat16", "float32")
# The lowest compute capability each choice runs on (TensorRT-LLM support matrix).
MIN_COMPUTE_CAPABILITY = {"bfloat16": (8, 0), "fp8": (8, 9), "int8_wo": (7, 0), "int4_wo": (7, 0)}


def release_for(version: str) -> Release | None:
    return RELEASES.get(version)


@dataclass(frozen=True)
class Step:
    """One command of a build: the phase it belongs to and its argv."""

    phase: str
    argv: list[str]


@dataclass(frozen=True)
class BuildPaths:
    checkpoint: Path  # the HuggingFace checkpoint (read-only)
    converted: Path  # TensorRT-LLM checkpoint written by the converter
    engine: Path  # the engine folder trtllm-build writes
    timing_cache: Path  # per GPU model and image


@dataclass(frozen=True)
class Toolchain:
    """How the commands are invoked: in the image, or by a host's python with tensorrt_llm."""

    python: list[str]
    trtllm_build: list[str]
    examples_dir: str
    trtllm_bench: list[str] = field(default_factory=lambda: ["trtllm-bench"])


def _flags(allowed: frozenset[str], pairs: list[tuple[str, Any]], tool: str, version: str) -> list[str]:
    argv: list[str] = []
    for flag, value in pairs:
        if flag not in allowed:
            raise ValueError(f"{tool} of TensorRT-LLM {version} has no {flag}")
        argv += [flag] if value is None else [flag, str(value)]
    return argv


def _plugin(choice: str, dtype: str) -> str:
    return dtype if choice == "auto" else choice


def compose(
    spec: dict[str, Any], release: Release, paths: BuildPaths, tools: Toolchain, architecture: str
) -> list[Step]:
    """The build's commands, in order: convert (or quantize), then trtllm-build.

    ``spec`` is a normalized build spec (deployments.build_spec.normalize_spec).
    Raises ValueError for an architecture the release has no converter for.
    """
    if architecture not in release.model_dirs:
        raise ValueError(f"TensorRT-LLM {release.version} has no converter for {architecture}")
    dtype = spec["dtype"]
    quantization = spec["quantization"]
    parallel = [("--tp_size", spec["tp_size"]), ("--pp_size", spec["pp_size"])]
    steps = []
    if quantization == "fp8":
        script = f"{tools.examples_dir}/quantization/quantize.py"
        pairs = [
            ("--model_dir", paths.checkpoint),
            ("--output_dir", paths.converted),
            ("--dtype", dtype),
            ("--qformat", "fp8"),
            ("--kv_cache_dtype", "fp8"),
            *parallel,
        ]
        steps.append(
            Step(
                "quantizing",
                [*tools.python, script, *_flags(release.quantize_flags, pairs, "quantize.py", release.version)],
            )
        )
    else:
        script = f"{tools.examples_dir}/{release.model_dirs[architecture]}/convert_checkpoint.py"
        pairs = [
            ("--model_dir", paths.checkpoint),
            ("--output_dir", paths.converted),
            ("--dtype", dtype),
            *parallel,
            ("--workers", spec["workers"]),
        ]
        if quantization in ("int8_wo", "int4_wo"):
            pairs += [("--use_weight_only", None), ("--weight_only_precision", quantization.removesuffix("_wo"))]
        steps.append(
            Step(
                "converting",
                [
                    *tools.python,
                    script,
                    *_flags(release.convert_flags, pairs, "convert_checkpoint.py", release.version),
                ],
            )
        )
    enable = {True: "enable", False: "disable"}
    pairs = [
        ("--checkpoint_dir", paths.converted),
        ("--output_dir", paths.engine),
        ("--max_batch_size", spec["max_batch_size"]),
        ("--max_input_len", spec["max_input_len"]),
        ("--max_seq_len", spec["max_seq_len"]),
        ("--max_num_tokens", spec["max_num_tokens"]),
        ("--max_beam_width", spec["max_beam_width"]),
        ("--gemm_plugin", _plugin(spec["gemm_plugin"], dtype)),
        ("--gpt_attention_plugin", _plugin(spec["gpt_attention_plugin"], dtype)),
        ("--context_fmha", enable[spec["context_fmha"]]),
        ("--use_paged_context_fmha", enable[spec["paged_context_fmha"]]),
        ("--remove_input_padding", enable[spec["remove_input_padding"]]),
        release.paged_kv_cache,
        ("--input_timing_cache", paths.timing_cache),
        ("--output_timing_cache", paths.timing_cache),
        ("--workers", spec["workers"]),
        ("--log_level", "info"),
    ]
    steps.append(
        Step("building", [*tools.trtllm_build, *_flags(release.build_flags, pairs, "trtllm-build", release.version)])
    )
    return steps


# --- trtllm-bench: the native ceiling of a load test ------------------------------


def bench_refusal(release: Release) -> str:
    """Why this release's trtllm-bench cannot give a native ceiling ('' if it can)."""
    missing = [flag for flag in BENCH_NEEDS if flag not in release.bench_flags]
    if not missing:
        return ""
    return (
        f"trtllm-bench of TensorRT-LLM {release.version} has no {' or '.join(missing)}, which a native ceiling "
        f"needs (a concurrency matching the served step, and the JSON report its figures are read from)"
    )


@dataclass(frozen=True)
class BenchRun:
    """One trtllm-bench throughput run of an engine: what it reads and writes."""

    model_name: str  # trtllm-bench's --model: a name for its report
    checkpoint: Path  # the HuggingFace checkpoint the engine was built from (its tokenizer)
    engine: Path
    dataset: Path  # JSON lines: task_id, input_ids or prompt, output_tokens
    report: Path
    workspace: Path
    requests: int
    concurrency: int
    streaming: bool
    warmup: int
    kv_cache_fraction: float
    tp_size: int = 1
    pp_size: int = 1


def compose_bench(run: BenchRun, release: Release, tools: Toolchain) -> list[str]:
    """trtllm-bench's command line for ``run``: the engine (C++) path at one
    concurrency, with the JSON report. Raises ValueError where the release's
    trtllm-bench cannot (bench_refusal) or lacks a flag the run needs."""
    refusal = bench_refusal(release)
    if refusal:
        raise ValueError(refusal)
    version = release.version
    if "--model_path" in release.bench_global_flags:
        model = [("--model", run.model_name), ("--model_path", run.checkpoint)]
    else:
        # Before --model_path, --model itself was where the tokenizer came from.
        model = [("--model", run.checkpoint)]
    own = [*model, ("--workspace", run.workspace), ("--log_level", "info")]
    pairs: list[tuple[str, Any]] = [
        ("--engine_dir", run.engine),
        ("--dataset", run.dataset),
        ("--num_requests", run.requests),
        ("--concurrency", run.concurrency),
        ("--kv_cache_free_gpu_mem_fraction", run.kv_cache_fraction),
        ("--report_json", run.report),
        ("--warmup", run.warmup),
    ]
    if run.streaming:
        pairs.append(("--streaming", None))
    if run.tp_size > 1 or run.pp_size > 1:
        pairs += [("--tp", run.tp_size), ("--pp", run.pp_size)]
    return [
        *tools.trtllm_bench,
        *_flags(release.bench_global_flags, own, "trtllm-bench", version),
        "throughput",
        *_flags(release.bench_flags, pairs, "trtllm-bench throughput", version),
    ]
