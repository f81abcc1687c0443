"""config.pbtxt from Triton's own schema (model_config_pb2 + text_format).

Configs are built as protobuf messages and serialized by protobuf, never from
string templates; ``read_config`` parses a file back the same way, so what we
write is exactly what Triton reads.

Over 450 lines on purpose: every kind of model Gantry writes (sentence models,
the causal LM, the engine and generate model of a TensorRT-LLM placement, the
LLM-API model) shares the same batching, instance and tensor helpers here, and
the generate interface is declared once for every LLM path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from triton_server.names import engine_model

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
    timeout_action: str = "REJECT"  # or DELAY: what happens to a request past the timeout


@dataclass(frozen=True)
class Instances:
    count: int = 1
    kind: str = "KIND_CPU"  # KIND_CPU or KIND_GPU
    gpus: tuple[int, ...] = ()


EMBED = "embed"
RERANK = "rerank"


@dataclass(frozen=True)
class PythonModelSpec:
    """A python-backend sentence model (triton_server/python_models/sentence_model.py)."""

    name: str
    task: str  # EMBED or RERANK
    checkpoint_path: str
    batching: Batching
    instances: Instances = field(default_factory=Instances)
    gpu_memory_fraction: float = 0.1
    max_seq_len: int | None = None  # None: the checkpoint's own (its sentence-transformers config)
    dtype: str = "auto"  # float16 on a GPU, float32 on a CPU
    trust_remote_code: bool = False


CAUSAL_LM_MODEL_FILE = "causal_lm_model.py"


@dataclass(frozen=True)
class CausalLmSpec:
    """A HuggingFace causal LM on the python backend (python_models/causal_lm_model.py):
    decoupled, with the generate interface of the TensorRT-LLM route."""

    name: str
    checkpoint_path: str
    batching: Batching
    instances: Instances = field(default_factory=Instances)
    gpu_memory_fraction: float = 0.1
    trust_remote_code: bool = False
    dtype: str = "auto"  # bfloat16 or float16 on a GPU, float32 on a CPU
    max_num_sequences: int = 8
    max_seq_len: int = 2048

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
# What the engine's generate model takes beyond that (python_models/engine_generate_model.py):
# OpenAI's penalties, a logit bias, several sequences of one prompt, log-probabilities.
ENGINE_GENERATE_INPUTS: list[tuple[str, int, list[int]]] = [
    ("presence_penalty", mc.TYPE_FP32, [1]),
    ("frequency_penalty", mc.TYPE_FP32, [1]),
    ("logit_bias_ids", mc.TYPE_INT32, [-1]),
    ("logit_bias_values", mc.TYPE_FP32, [-1]),
    ("num_return_sequences", mc.TYPE_INT32, [1]),
    ("return_log_probs", mc.TYPE_BOOL, [1]),
    ("top_log_probs", mc.TYPE_INT32, [1]),
]
ENGINE_GENERATE_OUTPUTS: list[tuple[str, int, list[int]]] = [
    ("sequence_index", mc.TYPE_INT32, [1]),
    ("log_probs", mc.TYPE_STRING, [1]),  # JSON: one entry per token the response adds
]
# What the transformers model takes beyond the generate interface (python_models/causal_lm_model.py):
# those and a grammar (named as TensorRT-LLM's guided decoding names it).
CAUSAL_LM_INPUTS: list[tuple[str, int, list[int]]] = [
    *ENGINE_GENERATE_INPUTS,
    ("guided_decoding_guide_type", mc.TYPE_STRING, [1]),
    ("guided_decoding_guide", mc.TYPE_STRING, [1]),
]
CAUSAL_LM_OUTPUTS = ENGINE_GENERATE_OUTPUTS


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
        policy.timeout_action = mc.ModelQueuePolicy.TimeoutAction.Value(batching.timeout_action)
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
        # As wide as the checkpoint's modules make it (a Dense layer may change the width).
        _tensor(config.output, "EMBEDDING", mc.TYPE_FP32, [-1])
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
            "max_seq_len": str(spec.max_seq_len or ""),
            "dtype": spec.dtype,
            "trust_remote_code": str(spec.trust_remote_code).lower(),
        },
    )
    return config


def _generate_interface(
    name: str, batching: Batching, instances: Instances, *, inputs: list = (), outputs: list = ()
) -> mc.ModelConfig:
    """A decoupled python model with the generate interface (GENERATE_INPUTS ->
    GENERATE_OUTPUTS, and ``inputs`` -> ``outputs`` of its own), its batching and its instances."""
    config = mc.ModelConfig(name=name, backend="python")
    config.model_transaction_policy.decoupled = True
    for input_name, data_type, dims in [*GENERATE_INPUTS, *inputs]:
        _input(config, input_name, data_type, dims, optional=input_name not in GENERATE_REQUIRED)
    for output_name, data_type, dims in [*GENERATE_OUTPUTS, *outputs]:
        _tensor(config.output, output_name, data_type, dims)
    _apply_batching(config, batching)
    _apply_instances(config, instances)
    return config


def causal_lm_config(spec: CausalLmSpec) -> mc.ModelConfig:
    """Decoupled (it streams), with Triton's dynamic batcher handing concurrent
    requests to execute() together; the model batches them into one forward pass
    per token."""
    config = _generate_interface(
        spec.name, spec.batching, spec.instances, inputs=CAUSAL_LM_INPUTS, outputs=CAUSAL_LM_OUTPUTS
    )
    _parameters(
        config,
        {
            "checkpoint_path": spec.checkpoint_path,
            "max_num_sequences": str(spec.max_num_sequences),
            "max_seq_len": str(spec.max_seq_len),
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


# --- a TensorRT-LLM engine behind the generate interface --------------------------------

ENGINE_GENERATE_MODEL_FILE = "engine_generate_model.py"
# Copied beside every generating python model's model.py (python_models/gantry_text.py).
TEXT_HELPER_FILE = "gantry_text.py"
# Copied beside the causal-LM model's model.py (python_models/gantry_decode.py, gantry_grammar.py,
# gantry_send.py).
DECODE_HELPER_FILE = "gantry_decode.py"
GRAMMAR_HELPER_FILE = "gantry_grammar.py"
SEND_HELPER_FILE = "gantry_send.py"


@dataclass(frozen=True)
class TrtllmSpec:
    """An engine served by the tensorrtllm backend as ``<name>-engine``, behind
    ``<name>``: Gantry's generate model (python_models/engine_generate_model.py),
    which tokenizes, streams the engine's tokens and decodes them incrementally."""

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
    enable_kv_cache_reuse: bool = False
    enable_chunked_context: bool = True
    decoding_mode: str = ""  # "": the backend's default (top_k_top_p, or beam_search with beams)
    trust_remote_code: bool = False
    # The release's tensorrt_llm model takes num_return_sequences (upstream.trtllm.Release).
    num_return_sequences: bool = False

    @property
    def engine_model(self) -> str:
        return engine_model(self.name)

    @property
    def model_names(self) -> list[str]:
        """Load order: the engine before the generate model that calls it."""
        return [self.engine_model, self.name]


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


# Several sequences of one prompt, where the release's template has them (0.16 on).
_TRTLLM_SEQUENCES_INPUT = [("num_return_sequences", mc.TYPE_INT32, [1], _SCALAR, True, False)]
_TRTLLM_SEQUENCES_OUTPUT = [("sequence_index", mc.TYPE_INT32, [1])]


def _input(config: mc.ModelConfig, name: str, data_type: int, dims: list[int], *, scalar: bool = False,
           optional: bool = False, ragged: bool = False) -> None:  # fmt: skip
    tensor = config.input.add(name=name, data_type=data_type, dims=dims, optional=optional, allow_ragged_batch=ragged)
    if scalar:
        tensor.reshape.SetInParent()  # reshape: { shape: [ ] }


def tensorrtllm_model_config(spec: TrtllmSpec) -> mc.ModelConfig:
    """The engine model: backend tensorrtllm, in-flight batching, the engine folder
    as gpt_model_path, GPUs through gpu_device_ids while the instance group
    stays KIND_CPU (the backend places the engine itself), and an absolute
    KV-cache token budget so models sharing a GPU cannot starve each other.
    Streaming needs it decoupled; the generate model always streams from it."""
    config = mc.ModelConfig(name=spec.engine_model, backend="tensorrtllm")
    config.model_transaction_policy.decoupled = spec.decoupled
    _apply_batching(config, spec.batching)
    sequences = spec.num_return_sequences
    for name, data_type, dims, scalar, optional, ragged in [
        *_TRTLLM_INPUTS,
        *(_TRTLLM_SEQUENCES_INPUT if sequences else []),
    ]:
        _input(config, name, data_type, dims, scalar=scalar, optional=optional, ragged=ragged)
    for name, data_type, dims in [*_TRTLLM_OUTPUTS, *(_TRTLLM_SEQUENCES_OUTPUT if sequences else [])]:
        _tensor(config.output, name, data_type, dims)
    _apply_instances(config, Instances(count=1, kind="KIND_CPU"))
    parameters = {
        "max_beam_width": str(spec.max_beam_width),
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": spec.engine_dir,
        "batch_scheduler_policy": spec.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": f"{spec.kv_cache_free_gpu_mem_fraction:g}",
        "exclude_input_in_output": "true",  # each streamed response carries only its new tokens
        "enable_kv_cache_reuse": str(spec.enable_kv_cache_reuse).lower(),
        "enable_chunked_context": str(spec.enable_chunked_context).lower(),
        "gpu_device_ids": ",".join(map(str, spec.gpu_device_ids)),
        "executor_worker_path": "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker",
    }
    if spec.max_tokens_in_paged_kv_cache is not None:
        parameters["max_tokens_in_paged_kv_cache"] = str(spec.max_tokens_in_paged_kv_cache)
    if spec.decoding_mode:
        parameters["decoding_mode"] = spec.decoding_mode
    _parameters(config, parameters)
    return config


def engine_generate_config(spec: TrtllmSpec) -> mc.ModelConfig:
    """The generate interface (GENERATE_INPUTS -> GENERATE_OUTPUTS) in front of the
    engine: a decoupled python model that calls it (BLS) and streams its text.
    Clients queue here, so the placement's queue policy applies here too."""
    config = _generate_interface(
        spec.name, spec.batching, Instances(count=1, kind="KIND_CPU"), inputs=ENGINE_GENERATE_INPUTS,
        outputs=ENGINE_GENERATE_OUTPUTS,
    )  # fmt: skip
    _parameters(
        config,
        {
            "engine_model": spec.engine_model,
            "engine_dir": spec.engine_dir,
            "num_return_sequences": str(spec.num_return_sequences).lower(),
            "tokenizer_dir": spec.tokenizer_dir,
            "skip_special_tokens": "true",
            "trust_remote_code": str(spec.trust_remote_code).lower(),
        },
    )
    return config


def trtllm_configs(spec: TrtllmSpec) -> dict[str, mc.ModelConfig]:
    """Every model of the placement, by name, in load order."""
    return {spec.engine_model: tensorrtllm_model_config(spec), spec.name: engine_generate_config(spec)}


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
    max_batch_size: int  # the sequences in flight (max_num_sequences)
    max_tokens_in_kv_cache: int | None = None
    kv_cache_free_gpu_mem_fraction: float = 0.9
    enable_block_reuse: bool = False
    max_seq_len: int | None = None
    trust_remote_code: bool = False
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
    kv_cache: dict = {
        "free_gpu_memory_fraction": spec.kv_cache_free_gpu_mem_fraction,
        "enable_block_reuse": spec.enable_block_reuse,
    }
    if spec.max_tokens_in_kv_cache is not None:
        kv_cache["max_tokens"] = spec.max_tokens_in_kv_cache
    args = {
        "model": spec.checkpoint_path,
        "backend": "pytorch",
        "tensor_parallel_size": len(spec.gpu_device_ids),
        "max_batch_size": spec.max_batch_size,
        "kv_cache_config": kv_cache,
        "trust_remote_code": spec.trust_remote_code,
        "triton_config": {"max_batch_size": spec.max_batch_size, "decoupled": spec.decoupled},
    }
    if spec.max_seq_len:
        args["max_seq_len"] = spec.max_seq_len
    return args
