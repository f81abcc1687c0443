"""config.pbtxt through Triton's own schema: python models, engines and the generate model in front of them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from triton_server.config import (
    EMBED,
    ENGINE_GENERATE_INPUTS,
    ENGINE_GENERATE_OUTPUTS,
    GENERATE_INPUTS,
    GENERATE_OUTPUTS,
    RERANK,
    Batching,
    CausalLmSpec,
    Instances,
    PythonModelSpec,
    TrtllmSpec,
    parse_text,
    python_model_config,
    read_config,
    to_text,
    trtllm_configs,
    write_config,
)
from triton_server.repository import PYTHON_MODELS, write_repository


def _spec(**overrides) -> PythonModelSpec:
    values = {
        "name": "minilm",
        "task": EMBED,
        "checkpoint_path": "/models/all-MiniLM-L6-v2",
        "batching": Batching(max_batch_size=32, preferred_batch_sizes=(8, 16), max_queue_delay_us=2000),
        "instances": Instances(count=2, kind="KIND_GPU", gpus=(0,)),
        "gpu_memory_fraction": 0.05,
    }
    values.update(overrides)
    return PythonModelSpec(**values)


def test_written_config_parses_back_to_the_same_message(tmp_path: Path):
    config = python_model_config(_spec())
    write_config(tmp_path / "minilm", config)
    assert read_config(tmp_path / "minilm") == config


def test_embedding_config_fields():
    config = parse_text(to_text(python_model_config(_spec())))
    assert config.name == "minilm"
    assert config.backend == "python"
    assert config.max_batch_size == 32
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("TEXT", mc.TYPE_STRING, [1])]
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [
        ("EMBEDDING", mc.TYPE_FP32, [-1]),  # as wide as the checkpoint's modules make it
        ("NUM_TOKENS", mc.TYPE_INT32, [1]),  # the gateway's usage
    ]
    assert list(config.dynamic_batching.preferred_batch_size) == [8, 16]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    group = config.instance_group[0]
    assert (group.kind, group.count, list(group.gpus)) == (mc.ModelInstanceGroup.KIND_GPU, 2, [0])
    assert config.parameters["checkpoint_path"].string_value == "/models/all-MiniLM-L6-v2"
    assert config.parameters["gpu_memory_fraction"].string_value == "0.05"
    # The checkpoint's own length and precision unless the placement names them.
    assert (config.parameters["max_seq_len"].string_value, config.parameters["dtype"].string_value) == ("", "auto")
    assert config.parameters["trust_remote_code"].string_value == "false"


def test_sentence_model_takes_the_seeds_precision_length_and_remote_code():
    config = python_model_config(_spec(dtype="float16", max_seq_len=512, trust_remote_code=True))
    parameters = {k: v.string_value for k, v in config.parameters.items()}
    assert (parameters["dtype"], parameters["max_seq_len"], parameters["trust_remote_code"]) == (
        "float16",
        "512",
        "true",
    )


def test_cpu_instances_name_no_gpus():
    config = python_model_config(_spec(instances=Instances(count=1, kind="KIND_CPU")))
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    assert list(config.instance_group[0].gpus) == []


def test_repository_layout_and_rewrite_replaces_old_models(tmp_path: Path):
    root = tmp_path / "repository"
    assert write_repository(root, [_spec(), _spec(name="other")]) == ["minilm", "other"]
    assert (root / "minilm" / "config.pbtxt").is_file()
    assert (root / "minilm" / "1" / "model.py").read_text().startswith('"""Triton python-backend model')
    write_repository(root, [_spec()])
    assert sorted(p.name for p in root.iterdir()) == ["minilm"]


def test_reranker_config_takes_a_query_and_passages_and_gives_one_score_each():
    config = parse_text(to_text(python_model_config(_spec(name="rerank", task=RERANK))))
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
        ("QUERY", mc.TYPE_STRING, [1]),
        ("PASSAGES", mc.TYPE_STRING, [-1]),
    ]
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [
        ("SCORES", mc.TYPE_FP32, [-1]),
        ("NUM_TOKENS", mc.TYPE_INT32, [1]),
    ]
    assert config.parameters["task"].string_value == "rerank"


def test_priority_levels_and_queue_policy():
    batching = Batching(
        max_batch_size=8, priority_levels=2, default_priority_level=2, queue_timeout_us=500_000, max_queue_size=64
    )
    config = parse_text(to_text(python_model_config(_spec(batching=batching))))
    dynamic = config.dynamic_batching
    assert (dynamic.priority_levels, dynamic.default_priority_level) == (2, 2)
    policy = dynamic.default_queue_policy
    assert policy.timeout_action == mc.ModelQueuePolicy.REJECT
    delayed = python_model_config(
        _spec(batching=Batching(max_batch_size=8, queue_timeout_us=1000, timeout_action="DELAY"))
    )
    assert delayed.dynamic_batching.default_queue_policy.timeout_action == mc.ModelQueuePolicy.DELAY
    assert (policy.default_timeout_microseconds, policy.max_queue_size, policy.allow_timeout_override) == (
        500_000,
        64,
        True,
    )


def test_no_queue_policy_unless_asked():
    config = python_model_config(_spec())
    assert not config.dynamic_batching.HasField("default_queue_policy")
    assert config.dynamic_batching.priority_levels == 0


SEEDS = Path(__file__).resolve().parents[4] / "shared" / "seeds"


def _seed_config(seed: str, start: str, end: str, substitutions: dict[str, str]) -> mc.ModelConfig:
    text = (SEEDS / seed).read_text()
    block = text[text.index(start) + len(start) : text.index(end)]
    block = "\n".join(line for line in block.splitlines() if not line.startswith(("#", "LLM configuration")))
    for old, new in substitutions.items():
        block = block.replace(old, new)
    return parse_text(block)


def _engine_spec(**overrides) -> TrtllmSpec:  # noqa: ANN003
    values = {
        "name": "llama",
        "engine_dir": "/data/builds/7/engine",
        "tokenizer_dir": "/models/llama",
        "batching": Batching(max_batch_size=32, preferred_batch_sizes=(32,), max_queue_delay_us=100),
        "gpu_device_ids": (0,),
        "max_tokens_in_paged_kv_cache": 20000,
    }
    return TrtllmSpec(**{**values, **overrides})


@pytest.fixture
def seed_configs() -> list[mc.ModelConfig]:
    if not SEEDS.is_dir():
        pytest.skip("the seeds are not beside this checkout")
    return [
        _seed_config(
            "002_79425276397cc8d5.txt",
            "triton_repo/gpt_oss_20b/config.pbtxt",
            "triton_repo/bge_reranker/config.pbtxt",
            {"__MAX_BATCH_SIZE_GPT__": "32", "__KV_CACHE_FRACTION__": "0.9"},
        ),
        # The seed writes TYPE_BYTES; Triton's schema calls that type TYPE_STRING.
        _seed_config(
            "004_c7c78437bd81929d.txt",
            "# llama3_8b/config.pbtxt",
            "Ensemble Pipeline for RAG",
            {"TYPE_BYTES": "TYPE_STRING"},
        ),
    ]


def test_engine_config_accepts_what_the_seeds_send(seed_configs):
    ours = trtllm_configs(_engine_spec())["llama-engine"]
    assert parse_text(str(ours)) == ours  # what we write parses back to itself
    inputs = {t.name: t for t in ours.input}
    outputs = {t.name: t for t in ours.output}
    for seed in seed_configs:
        assert seed.backend == ours.backend == "tensorrtllm"
        for tensor in seed.input:
            if tensor.name == "sampling_config":
                continue  # not an input of the tensorrtllm backend's template
            assert inputs[tensor.name].data_type == tensor.data_type, tensor.name
            assert inputs[tensor.name].optional == tensor.optional, tensor.name
        for tensor in seed.output:
            assert outputs[tensor.name].data_type == tensor.data_type
        for key in ("executor_worker_path", "max_beam_width", "max_tokens_in_paged_kv_cache",
                    "kv_cache_free_gpu_mem_fraction"):  # fmt: skip
            if key in seed.parameters:
                assert key in ours.parameters, key
        if "executor_worker_path" in seed.parameters:
            assert ours.parameters["executor_worker_path"] == seed.parameters["executor_worker_path"]
    assert seed_configs[0].model_transaction_policy.decoupled and ours.model_transaction_policy.decoupled
    assert ours.parameters["kv_cache_free_gpu_mem_fraction"].string_value == "0.9"


def test_engine_config_follows_the_backend_template_where_the_seeds_simplify():
    config = trtllm_configs(_engine_spec(gpu_device_ids=(0, 1), batch_scheduler_policy="max_utilization"))[
        "llama-engine"
    ]
    parameters = {k: v.string_value for k, v in config.parameters.items()}
    assert parameters["gpt_model_path"] == "/data/builds/7/engine"  # the seeds' "engine_dir"
    assert parameters["gpt_model_type"] == "inflight_fused_batching"
    assert parameters["batch_scheduler_policy"] == "max_utilization"  # the seeds' "scheduler_policy"
    assert parameters["gpu_device_ids"] == "0,1"
    assert parameters["max_tokens_in_paged_kv_cache"] == "20000"
    # The backend places the engine on gpu_device_ids; its instance group stays KIND_CPU.
    assert [(g.kind, list(g.gpus)) for g in config.instance_group] == [(mc.ModelInstanceGroup.KIND_CPU, [])]
    lengths = next(t for t in config.input if t.name == "input_lengths")
    assert lengths.HasField("reshape") and list(lengths.reshape.shape) == []
    assert next(t for t in config.input if t.name == "input_ids").allow_ragged_batch


def test_engine_config_carries_the_seeds_runtime_settings():
    config = trtllm_configs(
        _engine_spec(kv_cache_free_gpu_mem_fraction=0.92, enable_kv_cache_reuse=True, decoding_mode="top_p")
    )["llama-engine"]
    parameters = {k: v.string_value for k, v in config.parameters.items()}
    assert parameters["kv_cache_free_gpu_mem_fraction"] == "0.92"  # the seeds tune 0.92
    assert (parameters["enable_kv_cache_reuse"], parameters["decoding_mode"]) == ("true", "top_p")
    # Each streamed response carries only its new tokens: the generate model decodes them all together.
    assert parameters["exclude_input_in_output"] == "true"
    assert "decoding_mode" not in trtllm_configs(_engine_spec())["llama-engine"].parameters


def test_the_generate_model_calls_the_engine_with_inputs_it_declares():
    """The generate model (python_models/engine_generate_model.py) is the generate
    interface in front of the engine: decoupled, every generate input and
    output, and only engine inputs the engine model declares."""
    configs = trtllm_configs(_engine_spec())
    generate, engine = configs["llama"], configs["llama-engine"]
    assert (generate.backend, generate.model_transaction_policy.decoupled) == ("python", True)
    assert [t.name for t in generate.input] == [name for name, _, _ in [*GENERATE_INPUTS, *ENGINE_GENERATE_INPUTS]]
    assert [t.name for t in generate.output] == [  # num_input_tokens too
        name for name, _, _ in [*GENERATE_OUTPUTS, *ENGINE_GENERATE_OUTPUTS]
    ]
    assert generate.parameters["engine_model"].string_value == "llama-engine"
    assert generate.parameters["engine_dir"].string_value == _engine_spec().engine_dir  # its vocabulary's size
    assert generate.parameters["tokenizer_dir"].string_value == "/models/llama"
    code = (PYTHON_MODELS / "engine_generate_model.py").read_text()
    # It reads every input it declares, and asks the engine only for outputs the engine declares.
    read = set(re.findall(r'_values\(request, "(\w+)"\)', code)) | set(re.findall(r'    "(\w+)": \(', code))
    assert {t.name for t in generate.input} <= read, {t.name for t in generate.input} - read
    asked = set(re.findall(r'"(output_\w+|sequence_length)"', code))
    assert asked <= {t.name for t in engine.output}, asked - {t.name for t in engine.output}
    # Every tensor it builds, and the engine names of its SAMPLING table ("top_k": ("runtime_top_k", ...)).
    sent = set(re.findall(r'tensor\("(\w+)"', code)) | set(re.findall(r'"\w+": \("(\w+)", np\.\w+\)', code))
    declared = {t.name for t in engine.input}
    assert sent <= declared, sent - declared
    assert {t.name for t in engine.input if not t.optional} <= sent


def test_repository_holds_the_engine_and_the_generate_model_with_its_code(tmp_path: Path):
    names = write_repository(tmp_path / "repo", [_engine_spec()])
    assert names == ["llama-engine", "llama"]
    for name, config in trtllm_configs(_engine_spec()).items():
        assert read_config(tmp_path / "repo" / name) == config
    assert (tmp_path / "repo" / "llama" / "1" / "model.py").read_text() == (
        PYTHON_MODELS / "engine_generate_model.py"
    ).read_text()
    assert (tmp_path / "repo" / "llama" / "1" / "gantry_text.py").is_file()
    assert not (tmp_path / "repo" / "llama-engine" / "1" / "model.py").exists()


def test_repository_holds_the_causal_lm_with_its_decoder_and_text_helpers(tmp_path: Path):
    spec = CausalLmSpec(name="chat", checkpoint_path="/models/tiny", batching=Batching(max_batch_size=8))
    assert write_repository(tmp_path / "repo", [spec]) == ["chat"]
    version = tmp_path / "repo" / "chat" / "1"
    assert (version / "model.py").read_text() == (PYTHON_MODELS / "causal_lm_model.py").read_text()
    for helper in ("gantry_decode.py", "gantry_grammar.py", "gantry_send.py", "gantry_text.py"):
        assert (version / helper).read_text() == (PYTHON_MODELS / helper).read_text()
