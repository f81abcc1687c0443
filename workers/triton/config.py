"""config.pbtxt from Triton's own schema (model_config_pb2 + text_format).

Configs are built as protobuf messages and serialized by protobuf, never from
string templates; ``read_config`` parses a file back the same way, so what we
write is exactly what Triton reads.

Over 400 lines on purpose: every kind of model Gantry writes (sentence models,
the causal LM, the four models of a TensorRT-LLM stack, the LLM-API model)
shares the same batching, instance and tensor helpers here, and the generate
interface is declared once for the causal LM and the ensemble alike.
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


CAUSAL_LM_MODEL_FILE = "causal_lm_model.py"


@dataclass(frozen=True)
class CausalLmSpec:
    """A HuggingFace causal LM on the python backend (python_models/causal_lm_model.py):
    decoupled, with the TensorRT-LLM ensemble's inputs and outputs."""

    name: str
    checkpoint_path: str
    batching: Batching
    instances: Instances = field(default_factory=Instances)
    gpu_memory_fraction: float = 0.1
    trust_remote_code: bool = False
    dtype: str = "auto"  # bfloat16 or float16 on a GPU, float32 on a CPU

    @property
    def model_names(self) -> list[str]:
        return [self.name]


# The generate interface every LLM placement shares (name, type, dims): what the
# TensorRT-LLM ensemble takes, and what the transformers model takes too.
GENERATE_INPUTS: list[tuple[str, int, list[int]]] = [
    ("text_input", mc.TYPE_STRING, [1]),
    ("max_tokens", mc.TYPE_INT32, [1]),
    ("temperature", mc.TYPE_FP32, [1]),
    ("top_p", mc.TYPE_FP32, [1]),
    ("top_k", mc.TYPE_INT32, [1]),
    ("random_seed", mc.TYPE_UINT64, [1]),
    ("repetition_penalty", mc.TYPE_FP32, [1]),
    ("stop_words", mc.TYPE_STRING, [-1]),
    ("stream", mc.TYPE_BOOL, [1]),
]
GENERATE_REQUIRED = ("text_input", "max_tokens")
GENERATE_OUTPUTS: list[tuple[str, int, list[int]]] = [
    ("text_output", mc.TYPE_STRING, [-1]),
    ("num_input_tokens", mc.TYPE_INT32, [1]),
    ("num_output_tokens", mc.TYPE_INT32, [1]),
]


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
    """Embedding: TEXT (string) in, EMBEDDING (fp32) and NUM_TOKENS (int32) out.
    Reranker: QUERY (one string) and PASSAGES (strings) in, SCORES (fp32, one per
    passage) and NUM_TOKENS (all pairs) out. The token counts are the gateway's usage."""
    config = mc.ModelConfig(name=spec.name, backend="python")
    if spec.task == EMBED:
        _tensor(config.input, "TEXT", mc.TYPE_STRING, [1])
        _tensor(config.output, "EMBEDDING", mc.TYPE_FP32, [spec.embedding_dim])
        _tensor(config.output, "NUM_TOKENS", mc.TYPE_INT32, [1])
    elif spec.task == RERANK:
        _tensor(config.input, "QUERY", mc.TYPE_STRING, [1])
        _tensor(config.input, "PASSAGES", mc.TYPE_STRING, [-1])
        _tensor(config.output, "SCORES", mc.TYPE_FP32, [-1])
        _tensor(config.output, "NUM_TOKENS", mc.TYPE_INT32, [1])
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


def causal_lm_config(spec: CausalLmSpec) -> mc.ModelConfig:
    """Decoupled (it streams), with Triton's dynamic batcher handing concurrent
    requests to execute() together; the model batches them into one forward pass
    per token."""
    config = mc.ModelConfig(name=spec.name, backend="python")
    config.model_transaction_policy.decoupled = True
    for name, data_type, dims in GENERATE_INPUTS:
        _input(config, name, data_type, dims, optional=name not in GENERATE_REQUIRED)
    for name, data_type, dims in GENERATE_OUTPUTS:
        _tensor(config.output, name, data_type, dims)
    _apply_batching(config, spec.batching)
    _apply_instances(config, spec.instances)
    _parameters(
        config,
        {
            "checkpoint_path": spec.checkpoint_path,
            "max_batch_size": str(spec.batching.max_batch_size),
            "gpu_memory_fraction": f"{spec.gpu_memory_fraction:g}",
            "trust_remote_code": str(spec.trust_remote_code).lower(),
            "dtype": spec.dtype,
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


# --- the TensorRT-LLM stack (tensorrtllm_backend's inflight_batcher_llm layout) ---------

PREPROCESSING = "preprocessing"


def trtllm_preprocessing_model(name: str) -> str:
    """The tokenizer model beside the ensemble named ``name`` (also how the gateway counts prompt tokens)."""
    return f"{name}-{PREPROCESSING}"


POSTPROCESSING = "postprocessing"
TOKENIZER_MODEL_FILE = "tokenizer_model.py"


@dataclass(frozen=True)
class TrtllmSpec:
    """An engine served by the tensorrtllm backend, with the tokenizer models and
    the ensemble that let a client send text. ``name`` is the ensemble's name;
    the engine model is ``<name>-engine``, the tokenizer models
    ``<name>-preprocessing`` and ``<name>-postprocessing``."""

    name: str
    engine_dir: str
    tokenizer_dir: str
    batching: Batching
    gpu_device_ids: tuple[int, ...]
    max_beam_width: int = 1
    batch_scheduler_policy: str = "guaranteed_no_evict"  # or max_utilization
    kv_cache_free_gpu_mem_fraction: float = 0.9
    max_tokens_in_paged_kv_cache: int | None = None
    decoupled: bool = True  # streaming responses
    exclude_input_in_output: bool = True
    enable_kv_cache_reuse: bool = False
    enable_chunked_context: bool = True
    tokenizer_instances: int = 1

    @property
    def engine_model(self) -> str:
        return f"{self.name}-engine"

    @property
    def preprocessing_model(self) -> str:
        return trtllm_preprocessing_model(self.name)

    @property
    def postprocessing_model(self) -> str:
        return f"{self.name}-{POSTPROCESSING}"

    @property
    def model_names(self) -> list[str]:
        """Load order: the engine and tokenizers before the ensemble that needs them."""
        return [self.engine_model, self.preprocessing_model, self.postprocessing_model, self.name]


# (name, type, dims, reshape to scalar, optional, ragged) of the engine model's inputs,
# as tensorrtllm_backend's tensorrt_llm/config.pbtxt template declares them.
_SCALAR = True
_TRTLLM_INPUTS: list[tuple[str, int, list[int], bool, bool, bool]] = [
    ("input_ids", mc.TYPE_INT32, [-1], False, False, True),
    ("input_lengths", mc.TYPE_INT32, [1], _SCALAR, False, False),
    ("request_output_len", mc.TYPE_INT32, [1], False, False, False),
    ("end_id", mc.TYPE_INT32, [1], _SCALAR, True, False),
    ("pad_id", mc.TYPE_INT32, [1], _SCALAR, True, False),
    ("stop_words_list", mc.TYPE_INT32, [2, -1], False, True, True),
    ("bad_words_list", mc.TYPE_INT32, [2, -1], False, True, True),
    ("embedding_bias", mc.TYPE_FP32, [-1], False, True, True),
    ("beam_width", mc.TYPE_INT32, [1], _SCALAR, True, False),
    ("temperature", mc.TYPE_FP32, [1], _SCALAR, True, False),
    ("runtime_top_k", mc.TYPE_INT32, [1], _SCALAR, True, False),
    ("runtime_top_p", mc.TYPE_FP32, [1], _SCALAR, True, False),
    ("len_penalty", mc.TYPE_FP32, [1], _SCALAR, True, False),
    ("repetition_penalty", mc.TYPE_FP32, [1], _SCALAR, True, False),
    ("min_length", mc.TYPE_INT32, [1], _SCALAR, True, False),
    ("presence_penalty", mc.TYPE_FP32, [1], _SCALAR, True, False),
    ("frequency_penalty", mc.TYPE_FP32, [1], _SCALAR, True, False),
    ("random_seed", mc.TYPE_UINT64, [1], _SCALAR, True, False),
    ("return_log_probs", mc.TYPE_BOOL, [1], _SCALAR, True, False),
    ("return_context_logits", mc.TYPE_BOOL, [1], _SCALAR, True, False),
    ("return_generation_logits", mc.TYPE_BOOL, [1], _SCALAR, True, False),
    ("stop", mc.TYPE_BOOL, [1], False, True, False),
    ("streaming", mc.TYPE_BOOL, [1], False, True, False),
]
_TRTLLM_OUTPUTS = [
    ("output_ids", mc.TYPE_INT32, [-1, -1]),
    ("sequence_length", mc.TYPE_INT32, [-1]),
    ("cum_log_probs", mc.TYPE_FP32, [-1]),
    ("output_log_probs", mc.TYPE_FP32, [-1, -1]),
    ("context_logits", mc.TYPE_FP32, [-1, -1]),
    ("generation_logits", mc.TYPE_FP32, [-1, -1, -1]),
]


def _input(config: mc.ModelConfig, name: str, data_type: int, dims: list[int], *, scalar: bool = False,
           optional: bool = False, ragged: bool = False) -> None:  # fmt: skip
    tensor = config.input.add(name=name, data_type=data_type, dims=dims, optional=optional, allow_ragged_batch=ragged)
    if scalar:
        tensor.reshape.SetInParent()  # reshape: { shape: [ ] }


def tensorrtllm_model_config(spec: TrtllmSpec) -> mc.ModelConfig:
    """The engine model: backend tensorrtllm, in-flight batching, the engine folder
    as gpt_model_path, GPUs through gpu_device_ids while the instance group
    stays KIND_CPU (the backend places the engine itself), and an absolute
    KV-cache token budget so models sharing a GPU cannot starve each other."""
    config = mc.ModelConfig(name=spec.engine_model, backend="tensorrtllm")
    config.model_transaction_policy.decoupled = spec.decoupled
    _apply_batching(config, spec.batching)
    for name, data_type, dims, scalar, optional, ragged in _TRTLLM_INPUTS:
        _input(config, name, data_type, dims, scalar=scalar, optional=optional, ragged=ragged)
    for name, data_type, dims in _TRTLLM_OUTPUTS:
        _tensor(config.output, name, data_type, dims)
    _apply_instances(config, Instances(count=1, kind="KIND_CPU"))
    parameters = {
        "max_beam_width": str(spec.max_beam_width),
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": spec.engine_dir,
        "batch_scheduler_policy": spec.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": f"{spec.kv_cache_free_gpu_mem_fraction:g}",
        "exclude_input_in_output": str(spec.exclude_input_in_output).lower(),
        "enable_kv_cache_reuse": str(spec.enable_kv_cache_reuse).lower(),
        "enable_chunked_context": str(spec.enable_chunked_context).lower(),
        "gpu_device_ids": ",".join(map(str, spec.gpu_device_ids)),
        "executor_worker_path": "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker",
    }
    if spec.max_tokens_in_paged_kv_cache is not None:
        parameters["max_tokens_in_paged_kv_cache"] = str(spec.max_tokens_in_paged_kv_cache)
    _parameters(config, parameters)
    return config


def preprocessing_config(spec: TrtllmSpec) -> mc.ModelConfig:
    """Text in, token ids out (python backend, the checkpoint's tokenizer); stop
    strings become the engine's stop_words_list."""
    config = mc.ModelConfig(
        name=spec.preprocessing_model, backend="python", max_batch_size=spec.batching.max_batch_size
    )
    _input(config, "QUERY", mc.TYPE_STRING, [1])
    _input(config, "REQUEST_OUTPUT_LEN", mc.TYPE_INT32, [1])
    _input(config, "END_ID", mc.TYPE_INT32, [1], optional=True)
    _input(config, "PAD_ID", mc.TYPE_INT32, [1], optional=True)
    _input(config, "STOP_WORDS_DICT", mc.TYPE_STRING, [-1], optional=True)
    _tensor(config.output, "INPUT_ID", mc.TYPE_INT32, [-1])
    _tensor(config.output, "REQUEST_INPUT_LEN", mc.TYPE_INT32, [1])
    _tensor(config.output, "REQUEST_OUTPUT_LEN", mc.TYPE_INT32, [1])
    _tensor(config.output, "OUT_END_ID", mc.TYPE_INT32, [1])
    _tensor(config.output, "OUT_PAD_ID", mc.TYPE_INT32, [1])
    _tensor(config.output, "STOP_WORDS_IDS", mc.TYPE_INT32, [2, -1])
    _apply_instances(config, Instances(count=spec.tokenizer_instances, kind="KIND_CPU"))
    _parameters(config, {"task": PREPROCESSING, "tokenizer_dir": spec.tokenizer_dir})
    return config


def postprocessing_config(spec: TrtllmSpec) -> mc.ModelConfig:
    """Token ids in, text out (python backend, the checkpoint's tokenizer), with
    how many tokens each response adds."""
    config = mc.ModelConfig(
        name=spec.postprocessing_model, backend="python", max_batch_size=spec.batching.max_batch_size
    )
    _input(config, "TOKENS_BATCH", mc.TYPE_INT32, [-1, -1])
    _input(config, "SEQUENCE_LENGTH", mc.TYPE_INT32, [-1])
    _tensor(config.output, "OUTPUT", mc.TYPE_STRING, [-1])
    _tensor(config.output, "NUM_OUTPUT_TOKENS", mc.TYPE_INT32, [1])
    _apply_instances(config, Instances(count=spec.tokenizer_instances, kind="KIND_CPU"))
    _parameters(config, {"task": POSTPROCESSING, "tokenizer_dir": spec.tokenizer_dir, "skip_special_tokens": "true"})
    return config


def _step(config: mc.ModelConfig, model: str, inputs: dict[str, str], outputs: dict[str, str]) -> None:
    step = config.ensemble_scheduling.step.add(model_name=model, model_version=-1)
    for key, value in inputs.items():
        step.input_map[key] = value
    for key, value in outputs.items():
        step.output_map[key] = value


def ensemble_config(spec: TrtllmSpec) -> mc.ModelConfig:
    """preprocessing -> engine -> postprocessing behind the generate interface
    (GENERATE_INPUTS -> text_output and num_output_tokens), streamed when the
    client sets stream and the engine model is decoupled.

    num_input_tokens is not among its outputs: Triton refuses an ensemble
    whose outputs mix the decoupled engine's lineage with preprocessing's
    ("receives inputs originated from different decoupled models"), so
    callers read the prompt's token count as unknown on this route."""
    config = mc.ModelConfig(name=spec.name, platform="ensemble", max_batch_size=spec.batching.max_batch_size)
    for name, data_type, dims in GENERATE_INPUTS:
        _input(config, name, data_type, dims, optional=name not in GENERATE_REQUIRED)
    _input(config, "end_id", mc.TYPE_INT32, [1], optional=True)
    _input(config, "pad_id", mc.TYPE_INT32, [1], optional=True)
    for name, data_type, dims in GENERATE_OUTPUTS:
        if name != "num_input_tokens":
            _tensor(config.output, name, data_type, dims)
    _step(
        config,
        spec.preprocessing_model,
        {
            "QUERY": "text_input",
            "REQUEST_OUTPUT_LEN": "max_tokens",
            "END_ID": "end_id",
            "PAD_ID": "pad_id",
            "STOP_WORDS_DICT": "stop_words",
        },
        {
            "INPUT_ID": "_INPUT_ID",
            "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
            "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN",
            "OUT_END_ID": "_END_ID",
            "OUT_PAD_ID": "_PAD_ID",
            "STOP_WORDS_IDS": "_STOP_WORDS_IDS",
        },
    )
    _step(
        config,
        spec.engine_model,
        {
            "input_ids": "_INPUT_ID",
            "input_lengths": "_REQUEST_INPUT_LEN",
            "request_output_len": "_REQUEST_OUTPUT_LEN",
            "end_id": "_END_ID",
            "pad_id": "_PAD_ID",
            "stop_words_list": "_STOP_WORDS_IDS",
            "temperature": "temperature",
            "runtime_top_k": "top_k",
            "runtime_top_p": "top_p",
            "random_seed": "random_seed",
            "repetition_penalty": "repetition_penalty",
            "streaming": "stream",
        },
        {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"},
    )
    _step(
        config,
        spec.postprocessing_model,
        {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
        {"OUTPUT": "text_output", "NUM_OUTPUT_TOKENS": "num_output_tokens"},
    )
    return config


def trtllm_configs(spec: TrtllmSpec) -> dict[str, mc.ModelConfig]:
    """Every model of the stack, by name, in load order."""
    return {
        spec.engine_model: tensorrtllm_model_config(spec),
        spec.preprocessing_model: preprocessing_config(spec),
        spec.postprocessing_model: postprocessing_config(spec),
        spec.name: ensemble_config(spec),
    }


# --- the LLM-API path: a HuggingFace checkpoint served with no engine build ------------

LLMAPI_CONFIG_FILE = "model.yaml"


@dataclass(frozen=True)
class LlmApiSpec:
    """A checkpoint served by tensorrtllm_backend's LLM-API python model (from
    the image), configured by a model.yaml of ``LLM()`` arguments."""

    name: str
    checkpoint_path: str
    image_model_dir: str  # the LLM-API model folder inside the image
    gpu_device_ids: tuple[int, ...]
    max_batch_size: int
    max_tokens_in_kv_cache: int | None = None
    decoupled: bool = True

    @property
    def model_names(self) -> list[str]:
        return [self.name]


def llmapi_model_config(spec: LlmApiSpec) -> mc.ModelConfig:
    """Unbatched at Triton's level (the LLM API batches in flight itself):
    one prompt in, generated text out, streamed when decoupled."""
    config = mc.ModelConfig(name=spec.name, backend="python", max_batch_size=0)
    config.model_transaction_policy.decoupled = spec.decoupled
    _input(config, "text_input", mc.TYPE_STRING, [-1])
    _input(config, "streaming", mc.TYPE_BOOL, [1], optional=True)
    _tensor(config.output, "text_output", mc.TYPE_STRING, [-1])
    _apply_instances(config, Instances(count=1, kind="KIND_CPU"))
    return config


def llmapi_model_yaml(spec: LlmApiSpec) -> dict:
    """The model.yaml the LLM-API model reads: ``LLM()`` arguments plus triton_config."""
    kv_cache: dict = {"free_gpu_memory_fraction": 0.9}
    if spec.max_tokens_in_kv_cache is not None:
        kv_cache["max_tokens"] = spec.max_tokens_in_kv_cache
    return {
        "model": spec.checkpoint_path,
        "backend": "pytorch",
        "tensor_parallel_size": len(spec.gpu_device_ids),
        "max_batch_size": spec.max_batch_size,
        "kv_cache_config": kv_cache,
        "triton_config": {"max_batch_size": spec.max_batch_size, "decoupled": spec.decoupled},
    }
