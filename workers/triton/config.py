"""config.pbtxt from Triton's own schema (model_config_pb2 + text_format).

Configs are built as protobuf messages and serialized by protobuf, never from
string templates; ``read_config`` parses a file back the same way, so what we
write is exactly what Triton reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

CONFIG_FILE = "config.pbtxt"


@dataclass(frozen=True)
class Batching:
    max_batch_size: int
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    priority_levels: int = 0  # 0: a single queue
    default_priority_level: int = 0
    queue_timeout_us: int = 0  # 0: requests wait as long as it takes
    max_queue_size: int = 0  # 0: unbounded


@dataclass(frozen=True)
class Instances:
    count: int = 1
    kind: str = "KIND_CPU"  # KIND_CPU or KIND_GPU
    gpus: tuple[int, ...] = ()


EMBED = "embed"
RERANK = "rerank"


@dataclass(frozen=True)
class PythonModelSpec:
    """A python-backend sentence model (workers/triton/python_models/sentence_model.py)."""

    name: str
    task: str  # EMBED or RERANK
    checkpoint_path: str
    embedding_dim: int
    batching: Batching
    instances: Instances = field(default_factory=Instances)
    gpu_memory_fraction: float = 0.1
    max_length: int = 256


def _parameters(config: mc.ModelConfig, values: dict[str, str]) -> None:
    for key, value in values.items():
        config.parameters[key].string_value = value


def _apply_batching(config: mc.ModelConfig, batching: Batching) -> None:
    config.max_batch_size = batching.max_batch_size
    dynamic = config.dynamic_batching
    dynamic.preferred_batch_size.extend(batching.preferred_batch_sizes)
    dynamic.max_queue_delay_microseconds = batching.max_queue_delay_us
    if batching.priority_levels:
        dynamic.priority_levels = batching.priority_levels
        dynamic.default_priority_level = batching.default_priority_level
    if batching.queue_timeout_us or batching.max_queue_size:
        policy = dynamic.default_queue_policy
        policy.timeout_action = mc.ModelQueuePolicy.REJECT
        policy.default_timeout_microseconds = batching.queue_timeout_us
        policy.allow_timeout_override = True
        policy.max_queue_size = batching.max_queue_size


def _apply_instances(config: mc.ModelConfig, instances: Instances) -> None:
    group = config.instance_group.add()
    group.count = instances.count
    group.kind = mc.ModelInstanceGroup.Kind.Value(instances.kind)
    group.gpus.extend(instances.gpus)


def _tensor(container, name: str, data_type: int, dims: list[int]) -> None:  # noqa: ANN001 - protobuf field
    tensor = container.add()
    tensor.name = name
    tensor.data_type = data_type
    tensor.dims.extend(dims)


def python_model_config(spec: PythonModelSpec) -> mc.ModelConfig:
    """Embedding: TEXT (string) in, EMBEDDING (fp32) out.
    Reranker: QUERY (one string) and PASSAGES (strings) in, SCORES (fp32, one per passage) out."""
    config = mc.ModelConfig(name=spec.name, backend="python")
    if spec.task == EMBED:
        _tensor(config.input, "TEXT", mc.TYPE_STRING, [1])
        _tensor(config.output, "EMBEDDING", mc.TYPE_FP32, [spec.embedding_dim])
    elif spec.task == RERANK:
        _tensor(config.input, "QUERY", mc.TYPE_STRING, [1])
        _tensor(config.input, "PASSAGES", mc.TYPE_STRING, [-1])
        _tensor(config.output, "SCORES", mc.TYPE_FP32, [-1])
    else:
        raise ValueError(f"unknown task {spec.task!r}")
    _apply_batching(config, spec.batching)
    _apply_instances(config, spec.instances)
    _parameters(
        config,
        {
            "task": spec.task,
            "checkpoint_path": spec.checkpoint_path,
            "gpu_memory_fraction": f"{spec.gpu_memory_fraction:g}",
            "max_length": str(spec.max_length),
        },
    )
    return config


def to_text(config: mc.ModelConfig) -> str:
    return text_format.MessageToString(config)


def parse_text(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def write_config(model_dir: Path, config: mc.ModelConfig) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / CONFIG_FILE
    path.write_text(to_text(config))
    return path


def read_config(model_dir: Path) -> mc.ModelConfig:
    return parse_text((model_dir / CONFIG_FILE).read_text())
