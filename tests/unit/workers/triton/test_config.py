"""config.pbtxt through Triton's own schema: python models, engines, the ensemble."""

from __future__ import annotations

from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from workers.triton.config import (
    EMBED,
    RERANK,
    Batching,
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
from workers.triton.repository import write_repository


def _spec(**overrides) -> PythonModelSpec:
    values = {
        "name": "minilm",
        "task": EMBED,
        "checkpoint_path": "/models/all-MiniLM-L6-v2",
        "embedding_dim": 384,
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
        ("EMBEDDING", mc.TYPE_FP32, [384]),
        ("NUM_TOKENS", mc.TYPE_INT32, [1]),  # the gateway's usage
    ]
    assert list(config.dynamic_batching.preferred_batch_size) == [8, 16]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    group = config.instance_group[0]
    assert (group.kind, group.count, list(group.gpus)) == (mc.ModelInstanceGroup.KIND_GPU, 2, [0])
    assert config.parameters["checkpoint_path"].string_value == "/models/all-MiniLM-L6-v2"
    assert config.parameters["gpu_memory_fraction"].string_value == "0.05"


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
    assert (policy.default_timeout_microseconds, policy.max_queue_size, policy.allow_timeout_override) == (
        500_000,
        64,
        True,
    )


def test_no_queue_policy_unless_asked():
    config = python_model_config(_spec())
    assert not config.dynamic_batching.HasField("default_queue_policy")
    assert config.dynamic_batching.priority_levels == 0


SEEDS = Path(__file__).resolve().parents[5] / "shared" / "seeds"


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


def test_ensemble_wiring_is_complete():
    """What Triton checks when it loads an ensemble: every step reads tensors the
    ensemble has or an earlier step made, from inputs its model declares, and
    writes outputs its model declares; the ensemble's outputs are all produced."""
    configs = trtllm_configs(_engine_spec())
    ensemble = configs["llama"]
    assert ensemble.platform == "ensemble"
    available = {t.name for t in ensemble.input}
    for step in ensemble.ensemble_scheduling.step:
        model = configs[step.model_name]
        declared_in = {t.name for t in model.input}
        declared_out = {t.name for t in model.output}
        assert set(step.input_map) <= declared_in, step.model_name
        assert set(step.input_map.values()) <= available, step.model_name
        required = {t.name for t in model.input if not t.optional}
        assert required <= set(step.input_map), (step.model_name, required - set(step.input_map))
        assert set(step.output_map) <= declared_out, step.model_name
        available |= set(step.output_map.values())
    assert {t.name for t in ensemble.output} <= available
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == [
        "llama-preprocessing", "llama-engine", "llama-postprocessing",
    ]  # fmt: skip


def test_repository_holds_the_four_models_with_the_tokenizer_code(tmp_path: Path):
    names = write_repository(tmp_path / "repo", [_engine_spec()])
    assert names == ["llama-engine", "llama-preprocessing", "llama-postprocessing", "llama"]
    for name, config in trtllm_configs(_engine_spec()).items():
        assert read_config(tmp_path / "repo" / name) == config
    assert (tmp_path / "repo" / "llama-preprocessing" / "1" / "model.py").is_file()
    assert not (tmp_path / "repo" / "llama-engine" / "1" / "model.py").exists()
    tokenizer_dir = read_config(tmp_path / "repo" / "llama-postprocessing").parameters["tokenizer_dir"]
    assert tokenizer_dir.string_value == "/models/llama"
