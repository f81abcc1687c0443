"""TensorRT-LLM command lines composed against the per-release flag table."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployments import build_spec
from upstream import trtllm


def paths() -> trtllm.BuildPaths:
    return trtllm.BuildPaths(
        checkpoint=Path("/models/llama"),
        converted=Path("/data/builds/7/converted"),
        engine=Path("/data/builds/7/engine"),
        timing_cache=Path("/data/timing-cache/h100.cache"),
    )


def normalized(**overrides) -> dict:  # noqa: ANN003
    return {**build_spec.DEFAULTS, **overrides}


DOCKER_TOOLS = trtllm.Toolchain(
    python=["python3"], trtllm_build=["trtllm-build"], examples_dir="/app/tensorrt_llm/examples"
)


def test_command_lines_for_the_seeds_image_are_pinned():
    steps = trtllm.compose(normalized(), trtllm.RELEASES["0.16.0"], paths(), DOCKER_TOOLS, "LlamaForCausalLM")
    assert [s.phase for s in steps] == ["converting", "building"]
    assert steps[0].argv == [
        "python3", "/app/tensorrt_llm/examples/llama/convert_checkpoint.py",
        "--model_dir", "/models/llama", "--output_dir", "/data/builds/7/converted", "--dtype", "float16",
        "--tp_size", "1", "--pp_size", "1", "--workers", "1",
    ]  # fmt: skip
    assert steps[1].argv == [
        "trtllm-build",
        "--checkpoint_dir", "/data/builds/7/converted", "--output_dir", "/data/builds/7/engine",
        "--max_batch_size", "8", "--max_input_len", "1024", "--max_seq_len", "2048", "--max_num_tokens", "8192",
        "--max_beam_width", "1", "--gemm_plugin", "float16", "--gpt_attention_plugin", "float16",
        "--context_fmha", "enable", "--use_paged_context_fmha", "enable", "--remove_input_padding", "enable",
        "--kv_cache_type", "paged",
        "--input_timing_cache", "/data/timing-cache/h100.cache",
        "--output_timing_cache", "/data/timing-cache/h100.cache",
        "--workers", "1", "--log_level", "info",
    ]  # fmt: skip


def test_older_release_selects_the_paged_kv_cache_with_its_own_flag():
    steps = trtllm.compose(normalized(), trtllm.RELEASES["0.12.0"], paths(), DOCKER_TOOLS, "LlamaForCausalLM")
    build = steps[-1].argv
    assert "--kv_cache_type" not in build
    assert build[build.index("--paged_kv_cache") + 1] == "enable"


def test_newer_release_finds_converters_under_models_core():
    steps = trtllm.compose(normalized(), trtllm.RELEASES["0.20.0"], paths(), DOCKER_TOOLS, "Qwen2ForCausalLM")
    assert steps[0].argv[1] == "/app/tensorrt_llm/examples/models/core/qwen/convert_checkpoint.py"
    assert "--paged_kv_cache" not in steps[-1].argv


@pytest.mark.parametrize("version", sorted(trtllm.RELEASES))
@pytest.mark.parametrize("quantization", trtllm.QUANTIZATIONS)
def test_every_composed_flag_exists_in_its_release(version, quantization):
    release = trtllm.RELEASES[version]
    steps = trtllm.compose(
        normalized(quantization=quantization, tp_size=2, workers=2), release, paths(), DOCKER_TOOLS, "LlamaForCausalLM"
    )
    allowed = {
        "quantizing": release.quantize_flags,
        "converting": release.convert_flags,
        "building": release.build_flags,
    }
    for step in steps:
        flags = {arg for arg in step.argv if arg.startswith("--")}
        assert flags <= allowed[step.phase], (version, step.phase, flags - allowed[step.phase])


def test_fp8_quantizes_instead_of_converting_and_weight_only_converts_with_its_precision():
    fp8 = trtllm.compose(
        normalized(quantization="fp8"), trtllm.RELEASES["0.16.0"], paths(), DOCKER_TOOLS, "LlamaForCausalLM"
    )
    assert fp8[0].phase == "quantizing" and fp8[0].argv[1].endswith("quantization/quantize.py")
    assert ["--qformat", "fp8"] == fp8[0].argv[fp8[0].argv.index("--qformat") : fp8[0].argv.index("--qformat") + 2]
    int4 = trtllm.compose(
        normalized(quantization="int4_wo"), trtllm.RELEASES["0.16.0"], paths(), DOCKER_TOOLS, "LlamaForCausalLM"
    )
    assert "--use_weight_only" in int4[0].argv and int4[0].argv[-1] == "int4"


def test_flag_missing_from_a_release_is_refused_at_composition():
    release = trtllm.RELEASES["0.16.0"]
    stripped = trtllm.Release(**{**release.__dict__, "build_flags": release.build_flags - {"--max_num_tokens"}})
    with pytest.raises(ValueError, match="has no --max_num_tokens"):
        trtllm.compose(normalized(), stripped, paths(), DOCKER_TOOLS, "LlamaForCausalLM")


# --- trtllm-bench, the native ceiling of a load test --------------------------------

TOOLS = trtllm.Toolchain(python=["python3"], trtllm_build=["trtllm-build"], examples_dir="/x")


def _bench(**overrides) -> trtllm.BenchRun:  # noqa: ANN003
    values = {
        "model_name": "llama",
        "checkpoint": Path("/models/llama"),
        "engine": Path("/data/builds/3/engine"),
        "dataset": Path("/w/dataset.jsonl"),
        "report": Path("/w/report.json"),
        "workspace": Path("/w"),
        "requests": 200,
        "concurrency": 8,
        "streaming": True,
        "warmup": 2,
        "kv_cache_fraction": 0.5,
    }
    return trtllm.BenchRun(**{**values, **overrides})


def test_the_native_ceiling_command_line_is_pinned():
    argv = trtllm.compose_bench(_bench(), trtllm.RELEASES["0.20.0"], TOOLS)
    assert argv == [
        "trtllm-bench", "--model", "llama", "--model_path", "/models/llama", "--workspace", "/w",
        "--log_level", "info", "throughput", "--engine_dir", "/data/builds/3/engine",
        "--dataset", "/w/dataset.jsonl", "--num_requests", "200", "--concurrency", "8",
        "--kv_cache_free_gpu_mem_fraction", "0.5", "--report_json", "/w/report.json", "--warmup", "2", "--streaming",
    ]  # fmt: skip


def test_a_multi_gpu_engine_is_benchmarked_with_its_parallelism_and_no_streaming_when_off():
    argv = trtllm.compose_bench(_bench(tp_size=2, streaming=False), trtllm.RELEASES["0.20.0"], TOOLS)
    assert argv[-4:] == ["--tp", "2", "--pp", "1"] and "--streaming" not in argv


@pytest.mark.parametrize(("version", "missing"), [("0.12.0", "--concurrency or --report_json"),
                                                  ("0.16.0", "--report_json")])  # fmt: skip
def test_releases_whose_trtllm_bench_writes_no_report_give_no_native_ceiling(version, missing):
    release = trtllm.RELEASES[version]
    refusal = trtllm.bench_refusal(release)
    assert f"trtllm-bench of TensorRT-LLM {version} has no {missing}" in refusal
    with pytest.raises(ValueError, match=f"has no {missing}"):
        trtllm.compose_bench(_bench(), release, TOOLS)
    assert trtllm.bench_refusal(trtllm.RELEASES["0.20.0"]) == ""
