"""An llm's checkpoint through transformers' AutoModelForCausalLM on Triton's
python backend (python_models/causal_lm_model.py): runs wherever Triton's
python backend does, streamed (decoupled), on a GPU within its memory fraction
or on the CPU. Its memory is planned here: the 16-bit weights, a KV cache for
max_num_sequences sequences of max_seq_len tokens (allocated at load:
python_models/gantry_decode.py), and the activations of one prefill chunk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.words import a
from deployments.backends.base import (
    Fail,
    Placed,
    PlacementSpec,
    Resolved,
    ServingBackend,
    Target,
    batching,
    check_max_seq_len,
    check_precision,
    element_bytes,
    refuse_engine_only,
)
from deployments.backends.memory import dtype_bytes, kv_bytes_per_token, resolve_instances
from deployments.models import Backend, DeploymentModel, InstanceKind, ModelKind, RegisteredModel

# The transformers path prefills at most this many (padded) prompt tokens per
# forward pass (python_models/gantry_decode.py), so its activations are bounded.
PREFILL_TOKENS = 4096
# The context a transformers placement serves when it names none: the checkpoint's,
# capped so that a long-context checkpoint does not plan its KV cache for 128k tokens.
DEFAULT_MAX_SEQ_LEN = 4096
# A model with sliding-window (or other non-full) attention layers decodes with
# its own growing cache, which is re-allocated as it grows (old and new copies
# live together for a moment): its KV cache is planned twice. Full attention
# uses the decoder's slot cache, allocated once.
GROWING_CACHE_COPIES = 2


def kv_cache_sequences(config: dict[str, Any], max_num_sequences: int, max_seq_len: int) -> int:
    """How many sequences of max_seq_len tokens a transformers LLM's KV cache holds at
    once: the slot cache's, one slot per sequence and a scratch one (every layer full
    attention within max_seq_len), else GROWING_CACHE_COPIES times them (the same
    rule as gantry_decode.Decoder's)."""
    window = config.get("sliding_window")
    kinds = set(config.get("layer_types") or ["full_attention"])
    if (window and window < max_seq_len) or kinds != {"full_attention"}:
        return GROWING_CACHE_COPIES * max_num_sequences
    return max_num_sequences + 1


def transformers_max_seq_len(model: RegisteredModel, asked: int | None) -> int:
    """The context a transformers placement serves: what it asks, else the
    checkpoint's up to DEFAULT_MAX_SEQ_LEN."""
    if asked:
        return asked
    return min(model.max_position_embeddings or DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_SEQ_LEN)


@dataclass(frozen=True)
class TransformersNeeds:
    """What one instance of a transformers LLM holds on its GPU, in bytes."""

    weights: int
    kv_cache: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations


def transformers_needs(
    model: RegisteredModel, *, max_num_sequences: int, max_seq_len: int, element_bytes: int = 2
) -> TransformersNeeds:
    """The 16-bit (or fp32) weights, a KV cache for ``max_num_sequences`` sequences of
    ``max_seq_len`` tokens (kv_cache_sequences), and the
    activations of one prefill pass of PREFILL_TOKENS tokens (or one whole
    sequence, if longer) plus the logits of a decode step."""
    parameters = model.parameter_count or model.size_bytes // 2
    config = model.config or {}
    hidden = model.hidden_size or 0
    intermediate = int(config.get("intermediate_size") or 4 * hidden)
    vocab = model.vocab_size or int(config.get("vocab_size") or 0)
    kv = (
        kv_cache_sequences(config, max_num_sequences, max_seq_len)
        * max_seq_len
        * kv_bytes_per_token(model, None, element_bytes=element_bytes)
    )
    tokens = max(PREFILL_TOKENS, max_seq_len)
    # The MLP's gate, up and activation buffers and a few hidden-sized ones per token,
    # and fp32 logits for every sequence of a decode step, with as much again three times
    # over for what requests may ask (log-probabilities, token counts, logit biases).
    activations = tokens * (3 * intermediate + 6 * hidden) * element_bytes + 4 * max_num_sequences * vocab * 4
    return TransformersNeeds(weights=parameters * element_bytes, kv_cache=kv, activations=activations)


class Transformers(ServingBackend):
    key = Backend.TRANSFORMERS.value
    kinds = frozenset({ModelKind.LLM.value})
    generative = True
    generation_extras = frozenset({"penalties", "logit_bias", "guide", "n", "logprobs", "top_logprobs"})

    def check(self, spec: PlacementSpec, model: RegisteredModel, target: Target, fail: Fail) -> Resolved | None:
        """On a GPU each instance's fraction must hold its weights, a KV cache for
        max_num_sequences sequences of max_seq_len tokens and one prefill's activations."""
        if not spec.decoupled:
            fail("decoupled", "the transformers path always streams (a decoupled model): leave decoupled on")
        causal = model.architecture.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
        if not causal and not model.config.get("auto_map"):
            fail(
                "model",
                f"{model.name} is {a(model.architecture or 'model of unknown architecture')}, "
                "not a causal language model transformers can generate with",
            )
        refuse_engine_only(spec, fail, "the transformers path")
        if spec.max_num_sequences is not None and spec.max_num_sequences < spec.max_batch_size:
            fail("max_num_sequences", f"must be at least max_batch_size ({spec.max_batch_size}): a batch joins at once")
        host_gpus = target.gpus()
        kind, gpus = resolve_instances(spec.instance_kind, spec.gpu_ids, host_gpus)
        check_precision(spec, kind, gpus, host_gpus, fail)
        check_max_seq_len(spec, model, fail)
        resolved = Resolved(spec=spec, model=model, backend=self.key)
        if kind != InstanceKind.GPU:
            return resolved
        sequences = spec.max_num_sequences or spec.max_batch_size
        length = transformers_max_seq_len(model, spec.max_seq_len)
        try:
            needs = transformers_needs(
                model, max_num_sequences=sequences, max_seq_len=length, element_bytes=element_bytes(spec, kind)
            )
        except ValueError as exc:
            fail("model", str(exc))
            return resolved
        for index in gpus:
            gpu = host_gpus.get(index)
            if gpu is not None and spec.gpu_memory_fraction * gpu.memory_total_bytes < needs.total:
                fail(
                    "gpu_memory_fraction",
                    f"{spec.gpu_memory_fraction:g} of GPU {index}'s {gpu.memory_total_bytes / 2**30:.0f} GiB cannot "
                    f"hold {model.name}'s {needs.weights / 2**30:.2f} GiB of weights, a KV cache of "
                    f"{needs.kv_cache / 2**30:.2f} GiB for {sequences} sequences of {length} tokens and "
                    f"{needs.activations / 2**30:.2f} GiB of activations ({needs.total / 2**30:.2f} GiB in all)",
                )
        return resolved

    def memory(self, placement: DeploymentModel) -> dict[str, Any]:
        if placement.instance_kind == InstanceKind.CPU:
            return {}
        try:
            needs = transformers_needs(
                placement.registered_model,
                max_num_sequences=placement.max_num_sequences or placement.max_batch_size,
                max_seq_len=self.served_context(placement),
                element_bytes=dtype_bytes(placement.dtype),
            )
        except ValueError:
            return {}
        return {"weights_bytes": needs.weights, "kv_cache_bytes": needs.kv_cache, "activation_bytes": needs.activations}

    def served_context(self, placement: DeploymentModel) -> int | None:
        return transformers_max_seq_len(placement.registered_model, placement.max_seq_len)

    def placed(self, placement: DeploymentModel, kind: str, host_gpus: tuple[int, ...]) -> Placed:
        return Placed(
            triton_name=placement.triton_name, backend=self.key, instance_kind=kind,
            instance_count=placement.instance_count, gpus=host_gpus, max_seq_len=self.served_context(placement),
            max_num_sequences=placement.max_num_sequences or placement.max_batch_size,
        )  # fmt: skip

    def model_spec(self, placement: DeploymentModel, placed: Placed, devices: tuple[int, ...], image: str) -> Any:
        from triton_server.config import CausalLmSpec, Instances

        return CausalLmSpec(
            name=placement.triton_name,
            checkpoint_path=str(placement.registered_model.folder),
            batching=batching(placement),
            instances=Instances(count=placed.instance_count, kind=placed.instance_kind, gpus=devices),
            gpu_memory_fraction=placement.gpu_memory_fraction,
            trust_remote_code=placement.registered_model.trust_remote_code,
            dtype=placement.dtype,
            max_num_sequences=placed.max_num_sequences,
            max_seq_len=placed.max_seq_len,
        )
