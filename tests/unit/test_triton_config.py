from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from workers.triton.config import (
    EMBED,
    RERANK,
    Batching,
    Instances,
    PythonModelSpec,
    parse_text,
    python_model_config,
    read_config,
    to_text,
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
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [("EMBEDDING", mc.TYPE_FP32, [384])]
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
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [("SCORES", mc.TYPE_FP32, [-1])]
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
