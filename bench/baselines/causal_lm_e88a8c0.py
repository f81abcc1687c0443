# The causal-LM python model as it was at e88a8c0 (before gantry_decode.py): the
# hand-written loop issue 34 measured, kept verbatim as bench/decode.py's "old" side.
# Not served by Gantry. Its parameters: checkpoint_path, max_batch_size, dtype,
# trust_remote_code, gpu_memory_fraction.
"""Triton python-backend model: text generation from a HuggingFace causal-LM
checkpoint (whatever transformers' AutoModelForCausalLM loads from a folder).

Gantry copies this file to <repository>/<model>/1/model.py. Its inputs and
outputs are those of the TensorRT-LLM ensemble, so every door treats both
alike: text_input and max_tokens in; optional temperature, top_p, top_k,
random_seed, repetition_penalty, stop_words and stream; text_output out (one
response per new piece of text when streaming, else one), with
num_input_tokens and num_output_tokens (the tokens this response adds) so
callers can count usage.

The model is decoupled. execute() only queues requests; one generation thread
batches them continuously: between two decode steps, requests that arrived are
prefilled together (left-padded) and join the running batch (their KV caches
padded to a common length), and finished ones leave it, so N concurrent
streams cost about one forward pass per token instead of N, however they
arrive. Each sequence keeps its own sampling settings and random generator. A
request whose client went away (is_cancelled) stops at the next step. Models
whose cache is not a plain per-layer key/value cache (sliding windows, state
space layers) batch only the requests that arrive together.

Parameters (config.pbtxt): checkpoint_path, max_batch_size, dtype (auto:
bfloat16 or float16 on a GPU, float32 on a CPU), trust_remote_code, and on a
GPU instance gpu_memory_fraction, which caps this process's PyTorch
allocations on that GPU.
"""

import json
import queue
import threading
import time

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import DynamicLayer

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# How long a wave waits for more requests after the first arrives (seconds):
# concurrent clients rarely arrive in the same microsecond.
GATHER_S = 0.002


def _parameter(config, key, default):
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    return default if value in (None, "") else value


def _scalar(request, name, default, kind):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)
    if value.size == 0:
        return default
    value = value[0]
    if kind is str:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    return kind(value)


def _strings(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return []
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in tensor.as_numpy().reshape(-1)]


class _Sequence:
    """One request being generated: its prompt, settings, and what it has produced so far."""

    def __init__(self, request, tokenizer, context_len):
        self.sender = request.get_response_sender()
        prompt = _scalar(request, "text_input", "", str)
        self.max_tokens = _scalar(request, "max_tokens", 16, int)
        self.temperature = _scalar(request, "temperature", 1.0, float)
        self.top_p = _scalar(request, "top_p", 1.0, float)
        self.top_k = _scalar(request, "top_k", 0, int)
        self.repetition_penalty = _scalar(request, "repetition_penalty", 1.0, float)
        self.stream = _scalar(request, "stream", False, bool)
        self.stops = [s for s in _strings(request, "stop_words") if s]
        seed = _scalar(request, "random_seed", None, int)
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator().manual_seed(seed)
        if not prompt:
            raise ValueError("text_input is empty")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.repetition_penalty <= 0:
            raise ValueError("temperature >= 0, 0 < top_p <= 1, top_k >= 0 and repetition_penalty > 0")
        # Tokenized as the engine path's preprocessing does (with the tokenizer's
        # special tokens); a chat template, if any, was applied by the caller.
        self.prompt_ids = tokenizer.encode(prompt)
        if not self.prompt_ids:
            raise ValueError("text_input has no tokens")
        if len(self.prompt_ids) + self.max_tokens > context_len:
            raise ValueError(
                f"the prompt's {len(self.prompt_ids)} tokens plus max_tokens {self.max_tokens} exceed "
                f"the model's context of {context_len} tokens"
            )
        self.output_ids = []
        self.counted = 0  # output tokens already reported
        self.sent_chars = 0
        self.text = ""
        self.done = False

    def respond(self, text, final):
        tensors = [
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("num_input_tokens", np.array([len(self.prompt_ids)], dtype=np.int32)),
            pb_utils.Tensor("num_output_tokens", np.array([len(self.output_ids) - self.counted], dtype=np.int32)),
        ]
        self.counted = len(self.output_ids)
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if final else 0)


class _Batch:
    """Sequences decoding together: their KV cache, attention mask (left padding
    as zeros), each row's last position, and the logits of each row's next token."""

    def __init__(self, rows, past, attention, positions, logits):
        self.rows, self.past, self.attention, self.positions, self.logits = rows, past, attention, positions, logits

    @property
    def mergeable(self):
        layers = getattr(self.past, "layers", None)
        return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)

    def select(self, keep):
        index = torch.tensor(keep, device=self.attention.device)
        self.rows = [self.rows[i] for i in keep]
        self.attention, self.positions, self.logits = self.attention[index], self.positions[index], self.logits[index]
        for layer in self.past.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]

    def merge(self, other):
        """One batch of both: caches and masks left-padded to the longer one."""
        if not other.mergeable:
            raise RuntimeError("cannot join a cache of this kind")
        width = max(self.attention.shape[-1], other.attention.shape[-1])

        def pad(tensor, dim_from_end):
            missing = width - tensor.shape[-dim_from_end]
            if not missing:
                return tensor
            spec = [0, 0] * (dim_from_end - 1) + [missing, 0]
            return torch.nn.functional.pad(tensor, spec)

        self.attention = torch.cat([pad(self.attention, 1), pad(other.attention, 1)])
        for mine, theirs in zip(self.past.layers, other.past.layers, strict=True):
            mine.keys = torch.cat([pad(mine.keys, 2), pad(theirs.keys, 2)])
            mine.values = torch.cat([pad(mine.values, 2), pad(theirs.values, 2)])
        self.positions = torch.cat([self.positions, other.positions])
        self.logits = torch.cat([self.logits, other.logits])
        self.rows = self.rows + other.rows
        return self


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        checkpoint = _parameter(config, "checkpoint_path", None)
        if checkpoint is None:
            raise pb_utils.TritonModelException("parameter checkpoint_path is missing")
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("this model streams: its config must be decoupled")
        self.max_batch = max(1, int(_parameter(config, "max_batch_size", "8")))
        trust = _parameter(config, "trust_remote_code", "false") == "true"
        if args.get("model_instance_kind") == "GPU":
            device_id = int(args["model_instance_device_id"])
            fraction = float(_parameter(config, "gpu_memory_fraction", "0.1"))
            torch.cuda.set_per_process_memory_fraction(fraction, device=device_id)
            self.device = torch.device(f"cuda:{device_id}")
        else:
            self.device = torch.device("cpu")
        dtype = _parameter(config, "dtype", "auto")
        if dtype == "auto":
            if self.device.type == "cpu":
                dtype = "float32"
            else:
                dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=trust)
        self.model = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=getattr(torch, dtype), trust_remote_code=trust
        ).to(self.device)
        self.model.eval()
        model_config = self.model.config
        self.context_len = int(getattr(model_config, "max_position_embeddings", 0) or 2048)
        eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = getattr(model_config, "eos_token_id", None)
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)
        self.pending = queue.Queue()
        self.stopping = threading.Event()
        self.worker = threading.Thread(target=self._loop, name="gantry-generate", daemon=True)
        self.worker.start()
        pb_utils.Logger.log_info(
            f"causal LM {checkpoint} on {self.device} as {dtype}, waves of up to {self.max_batch}, "
            f"context {self.context_len} (torch {torch.__version__})"
        )

    def execute(self, requests):
        for request in requests:
            try:
                self.pending.put(_Sequence(request, self.tokenizer, self.context_len))
            except ValueError as exc:
                sender = request.get_response_sender()
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)
        return None

    # --- the generation thread --------------------------------------------------------

    def _take(self, block, room):
        """Requests waiting to join, up to ``room``; waits for the first only when idle."""
        taken = []
        while len(taken) < room:
            try:
                if block and not taken:
                    taken.append(self.pending.get(timeout=0.1))
                    deadline = time.monotonic() + GATHER_S
                else:
                    wait = max(0.0, deadline - time.monotonic()) if block else 0.0
                    taken.append(self.pending.get(timeout=wait) if wait else self.pending.get_nowait())
            except queue.Empty:
                break
        return taken

    def _loop(self):
        batch = None
        while not self.stopping.is_set():
            try:
                room = self.max_batch - (len(batch.rows) if batch else 0)
                if batch is None or batch.mergeable:
                    newcomers = self._take(block=batch is None, room=room)
                    if newcomers:
                        joined = self._prefill(newcomers)
                        batch = joined if batch is None else batch.merge(joined)
                if batch is not None:
                    batch = self._step(batch)
            except Exception as exc:  # noqa: BLE001 - every request in the batch gets the error
                pb_utils.Logger.log_error(f"generation failed: {exc}")
                for sequence in batch.rows if batch else []:
                    if not sequence.done:
                        error = pb_utils.TritonError(f"generation failed: {exc}")
                        sequence.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)
                        sequence.done = True
                batch = None

    @torch.inference_mode()
    def _prefill(self, sequences):
        longest = max(len(s.prompt_ids) for s in sequences)
        input_ids = torch.full((len(sequences), longest), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(sequences), longest), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            input_ids[row, longest - len(sequence.prompt_ids) :] = torch.tensor(sequence.prompt_ids)
            attention[row, longest - len(sequence.prompt_ids) :] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        outputs = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True)
        return _Batch(sequences, outputs.past_key_values, attention, positions[:, -1:], outputs.logits[:, -1, :])

    @torch.inference_mode()
    def _step(self, batch):
        """Sample each row's next token, send what is certain, drop finished rows, and
        run one forward pass for the rest; None when nothing is left."""
        chosen = []
        logits = batch.logits.float().cpu()  # one copy per step, not one per row
        for row, sequence in enumerate(batch.rows):
            if sequence.sender.is_cancelled():
                sequence.done = True
                sequence.sender.send(flags=FINAL)
                pb_utils.Logger.log_info(f"request cancelled by its client after {len(sequence.output_ids)} tokens")
                chosen.append(self.pad_id)
                continue
            token = self._sample(sequence, logits[row].clone())
            self._advance(sequence, token)
            chosen.append(token)
        keep = [row for row, sequence in enumerate(batch.rows) if not sequence.done]
        if not keep:
            return None
        batch.select(keep)
        tokens = torch.tensor([chosen[row] for row in keep], dtype=torch.long, device=self.device).unsqueeze(-1)
        ones = torch.ones((len(keep), 1), dtype=torch.long, device=self.device)
        batch.attention = torch.cat([batch.attention, ones], -1)
        batch.positions = batch.positions + 1
        outputs = self.model(
            input_ids=tokens,
            attention_mask=batch.attention,
            position_ids=batch.positions,
            past_key_values=batch.past,
            use_cache=True,
        )
        batch.past = outputs.past_key_values
        batch.logits = outputs.logits[:, -1, :]
        return batch

    def _sample(self, sequence, logits):
        if sequence.repetition_penalty != 1.0 and (sequence.output_ids or sequence.prompt_ids):
            seen = torch.tensor(sorted(set(sequence.prompt_ids + sequence.output_ids)))
            picked = logits[seen]
            logits[seen] = torch.where(
                picked > 0, picked / sequence.repetition_penalty, picked * sequence.repetition_penalty
            )
        if sequence.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / sequence.temperature
        if sequence.top_k:
            kth = torch.topk(logits, min(sequence.top_k, logits.numel())).values[-1]
            logits[logits < kth] = float("-inf")
        if sequence.top_p < 1.0:
            ordered, order = torch.sort(logits, descending=True)
            cumulative = torch.softmax(ordered, -1).cumsum(-1)
            drop = cumulative - torch.softmax(ordered, -1) > sequence.top_p
            logits[order[drop]] = float("-inf")
        probabilities = torch.softmax(logits, -1)
        return int(torch.multinomial(probabilities, 1, generator=sequence.generator))

    def _advance(self, sequence, token):
        """Record one generated token; send the text that is now certain; finish on
        end of sequence, a stop string, or max_tokens."""
        finished = token in self.eos_ids
        if not finished:
            sequence.output_ids.append(token)
        text = self.tokenizer.decode(sequence.output_ids, skip_special_tokens=True)
        for stop in sequence.stops:
            at = text.find(stop)
            if at != -1:
                text, finished = text[:at], True
        if len(sequence.output_ids) >= sequence.max_tokens:
            finished = True
        sequence.text = text
        if finished:
            sequence.done = True
            if sequence.stream:
                sequence.respond(text[sequence.sent_chars :], final=True)
            else:
                sequence.respond(text, final=True)
            return
        if not sequence.stream:
            return
        # Hold back a character that may still change (an incomplete UTF-8 sequence)
        # and a tail that may be the start of a stop string.
        certain = len(text.rstrip("\ufffd"))
        if sequence.stops:
            hold = max(len(s) for s in sequence.stops) - 1
            certain = min(certain, max(sequence.sent_chars, len(text) - hold))
        if certain > sequence.sent_chars:
            sequence.respond(text[sequence.sent_chars : certain], final=False)
            sequence.sent_chars = certain

    def finalize(self):
        self.stopping.set()
        self.worker.join(timeout=10)
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
