"""Triton python-backend model: the generate interface in front of a
TensorRT-LLM engine (a business-logic model, as tensorrtllm_backend's
tensorrt_llm_bls is).

Gantry copies this file to <repository>/<name>/1/model.py beside the engine
model <name>-engine (triton_server/config.py). It takes what the transformers
model takes (text_input, max_tokens, optional temperature, top_p, top_k,
random_seed, repetition_penalty, stop_words, stream) and answers the same
(text_output, num_input_tokens, num_output_tokens). Beyond that it takes what
TensorRT-LLM's engine model does of the transformers model's extras:
presence_penalty and frequency_penalty (passed as they are), a logit bias
(logit_bias_ids and logit_bias_values, made the engine's embedding_bias: one
value per token of the engine's vocabulary), num_return_sequences (from 0.16:
the engine samples them in its batch and names each response's
sequence_index, as this model's responses do) and return_log_probs (the
engine's output_log_probs, answered as log_probs: a JSON list, one OpenAI entry
per token). The engine returns no alternatives beside the chosen token, so
top_log_probs above 0 is refused, and it has no guided decoding input.

It tokenizes the prompt with the checkpoint's tokenizer, asks the engine for a
stream of tokens (stop strings become its stop_words_list), and decodes them
incrementally (gantry_text.TextStream): the whole output so far is decoded at
each step and only the text that is certain is sent. Decoding each response's
tokens alone, as tensorrtllm_backend's ensemble postprocessing does, drops the
spaces SentencePiece marks on a token and splits multi-byte characters.

A client that goes away ends the engine's request too (a stop request with the
same request id, as the tensorrtllm backend takes it).

Parameters (config.pbtxt): engine_model, engine_dir (its config.json gives
the vocabulary's size), num_return_sequences (whether the engine model takes
it), tokenizer_dir, skip_special_tokens, trust_remote_code.
Each request runs on a thread of its own, so concurrent streams reach the
engine together and it batches them in flight.
"""

import json
import os
import threading
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils
from gantry_text import TextStream, TokenTexts, logit_bias
from transformers import AutoTokenizer

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
MAX_SEQUENCES = 16  # num_return_sequences, as the transformers model takes it
# Generate-interface sampling inputs -> the engine model's inputs, with their types.
SAMPLING = {
    "temperature": ("temperature", np.float32),
    "top_k": ("runtime_top_k", np.int32),
    "top_p": ("runtime_top_p", np.float32),
    "random_seed": ("random_seed", np.uint64),
    "repetition_penalty": ("repetition_penalty", np.float32),
    "presence_penalty": ("presence_penalty", np.float32),
    "frequency_penalty": ("frequency_penalty", np.float32),
}


class _Sequence:
    """One sequence of a request: its text, and what was not yet reported of it."""

    def __init__(self, text, logprobs):
        self.text, self.counted, self.asked, self.entries = text, 0, logprobs, []

    def take(self):
        """Its output tokens since the last report."""
        added, self.counted = len(self.text.ids) - self.counted, len(self.text.ids)
        return added

    def logprobs(self):
        """Its logprobs entries since the last report (None when not asked)."""
        entries, self.entries = self.entries, []
        return entries if self.asked else None


def _parameter(config, key, default):
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    return default if value in (None, "") else value


def _values(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)


def _strings(values):
    return [] if values is None else [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("this model streams: its config must be decoupled")
        self.engine = _parameter(config, "engine_model", None)
        if self.engine is None:
            raise pb_utils.TritonModelException("parameter engine_model is missing")
        trust = _parameter(config, "trust_remote_code", "false") == "true"
        self.tokenizer = AutoTokenizer.from_pretrained(
            _parameter(config, "tokenizer_dir", None), trust_remote_code=trust
        )
        self.skip_special = _parameter(config, "skip_special_tokens", "true") == "true"
        self.token_texts = TokenTexts(self.tokenizer)
        self.vocab = self._vocab(_parameter(config, "engine_dir", None))
        self.several = _parameter(config, "num_return_sequences", "false") == "true"
        eos, sep = self.tokenizer.eos_token_id, self.tokenizer.sep_token_id
        self.end_id = eos if eos is not None else (sep if sep is not None else 0)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.end_id
        self.held_family = pb_utils.MetricFamily(
            name="gantry_requests_in_flight",
            description="Requests the model holds: generating on its engine",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self.in_flight = self.held_family.Metric(
            labels={"model": args["model_name"], "model_instance": args.get("model_instance_name", "")}
        )
        self.held, self.held_lock = 0, threading.Lock()
        self.in_flight.set(0)

    def _vocab(self, engine_dir):
        """The engine's vocabulary size (its embedding_bias is one value per token), from its
        config.json; the tokenizer's when the engine folder is not named."""
        if engine_dir:
            with open(os.path.join(engine_dir, "config.json")) as handle:
                pretrained = json.load(handle).get("pretrained_config", {})
            if isinstance(pretrained.get("vocab_size"), int):
                return pretrained["vocab_size"]
        return len(self.tokenizer)

    def execute(self, requests):
        self._count(len(requests))
        for request in requests:
            threading.Thread(target=self._serve, args=(request,), name="gantry-engine-request", daemon=True).start()
        return None

    def _count(self, change):
        """gantry_requests_in_flight: the requests this model holds, which a draining
        replica's host waits on (triton_server.metrics.in_flight)."""
        with self.held_lock:
            self.held += change
            self.in_flight.set(self.held)

    def _serve(self, request):
        sender = request.get_response_sender()
        try:
            self._generate(request, sender)
        except Exception as exc:  # noqa: BLE001 - the client gets the reason, the model keeps serving
            error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG if isinstance(exc, ValueError)
                                         else pb_utils.TritonError.INTERNAL)  # fmt: skip
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)
        finally:
            self._count(-1)

    def _generate(self, request, sender):
        prompt = _strings(_values(request, "text_input"))
        max_tokens = _values(request, "max_tokens")
        if not prompt or not prompt[0]:
            raise ValueError("text_input is empty")
        if max_tokens is None or int(max_tokens[0]) < 1:
            raise ValueError("max_tokens must be at least 1")
        stream = bool((_values(request, "stream") if _values(request, "stream") is not None else [False])[0])
        stops = [s for s in _strings(_values(request, "stop_words")) if s]
        logprobs = self._logprobs(request)
        n = self._sequences(request)
        ids = self.tokenizer.encode(prompt[0])
        inputs = self._engine_inputs(request, ids, int(max_tokens[0]), stops)
        if logprobs:
            inputs.append(pb_utils.Tensor("return_log_probs", np.array([[True]], dtype=np.bool_)))
        if n > 1:
            inputs.append(pb_utils.Tensor("num_return_sequences", np.array([[n]], dtype=np.int32)))
        outputs = ["output_ids", "sequence_length"] + (["output_log_probs"] if logprobs else [])
        sequences = [_Sequence(TextStream(self.tokenizer, stops, skip_special_tokens=self.skip_special), logprobs)
                     for _ in range(n)]  # fmt: skip
        request_id = f"gantry-{uuid.uuid4().hex}"
        responses = pb_utils.InferenceRequest(
            model_name=self.engine,
            inputs=inputs,
            requested_output_names=outputs + (["sequence_index"] if n > 1 else []),
            request_id=request_id,
        ).exec(decoupled=True)
        for response in responses:
            if sender.is_cancelled():
                self._stop(request_id)
                sender.send(flags=FINAL)
                return
            if response.has_error():
                raise RuntimeError(response.error().message())
            output = pb_utils.get_output_tensor_by_name(response, "output_ids")
            if output is None:
                continue  # the engine's empty final response
            index = pb_utils.get_output_tensor_by_name(response, "sequence_index") if n > 1 else None
            index = 0 if index is None else int(index.as_numpy().reshape(-1)[0])
            sequence = sequences[index]
            if sequence.text.stopped:
                continue  # its stop string came: the rest of its tokens are not its text
            lengths = pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy().reshape(-1)
            tokens = output.as_numpy().reshape(-1, output.as_numpy().shape[-1])[0][: int(lengths[0])].tolist()
            if logprobs:
                sequence.entries += self._entries(response, tokens)
            tokens = [t for t in tokens if t != self.end_id]
            piece = sequence.text.add(tokens)
            if stream and (piece or tokens):
                sender.send(self._response(piece, len(ids), sequence.take(), sequence.logprobs(), index))
            if all(s.text.stopped for s in sequences):
                self._stop(request_id)  # every text ended: the engine need not write on
                break
        for index, sequence in enumerate(sequences):
            rest = sequence.text.finish()
            text = rest if stream else sequence.text.text
            last = index == len(sequences) - 1
            response = self._response(text, len(ids), sequence.take(), sequence.logprobs(), index)
            sender.send(response, flags=FINAL if last else 0)

    def _sequences(self, request):
        """num_return_sequences: 1 unless asked, and only where the engine takes it."""
        asked = _values(request, "num_return_sequences")
        n = 1 if asked is None else int(asked[0])
        if not 1 <= n <= MAX_SEQUENCES:
            raise ValueError(f"num_return_sequences must be 1 to {MAX_SEQUENCES}")
        if n > 1 and not self.several:
            raise ValueError("num_return_sequences: this TensorRT-LLM release's engine model does not take it")
        return n

    @staticmethod
    def _logprobs(request):
        """Whether the request asks for its tokens' log-probabilities (the chosen ones only)."""
        asked = _values(request, "return_log_probs")
        if asked is None or not bool(asked[0]):
            return False
        top = _values(request, "top_log_probs")
        if top is not None and int(top[0]) > 0:
            raise ValueError("top_log_probs: TensorRT-LLM's engine returns only the chosen token's log-probability")
        return True

    def _entries(self, response, tokens):
        """The OpenAI logprobs entries of a response's tokens, but the end token: the engine's
        output_log_probs ([beam, tokens], the last ones this response's)."""
        found = pb_utils.get_output_tensor_by_name(response, "output_log_probs")
        values = [] if found is None else found.as_numpy().reshape(-1, found.as_numpy().shape[-1])[0].tolist()
        values = values[-len(tokens) :] if tokens else []
        if len(values) != len(tokens):
            raise RuntimeError(f"the engine returned {len(values)} log-probabilities for {len(tokens)} tokens")
        return [
            {**self.token_texts.entry(t, float(v)), "top_logprobs": []}
            for t, v in zip(tokens, values, strict=True)
            if t != self.end_id
        ]

    def _stop(self, request_id):
        """End the engine's request for a client that went away: the tensorrtllm
        backend cancels the request whose id a request with ``stop`` set names
        (this python backend's BLS iterator has no cancel of its own)."""
        inputs = [
            pb_utils.Tensor("input_ids", np.array([[self.end_id]], dtype=np.int32)),
            pb_utils.Tensor("input_lengths", np.array([[1]], dtype=np.int32)),
            pb_utils.Tensor("request_output_len", np.array([[1]], dtype=np.int32)),
            pb_utils.Tensor("stop", np.array([[True]], dtype=np.bool_)),
        ]
        for _ in pb_utils.InferenceRequest(
            model_name=self.engine, inputs=inputs, requested_output_names=[], request_id=request_id
        ).exec(decoupled=True):
            pass

    def _engine_inputs(self, request, ids, max_tokens, stops):
        def tensor(name, value, dtype):
            return pb_utils.Tensor(name, np.array(value, dtype=dtype))

        inputs = [
            tensor("input_ids", [ids], np.int32),
            tensor("input_lengths", [[len(ids)]], np.int32),
            tensor("request_output_len", [[max_tokens]], np.int32),
            tensor("end_id", [[self.end_id]], np.int32),
            tensor("pad_id", [[self.pad_id]], np.int32),
            tensor("streaming", [[True]], np.bool_),
            tensor("stop_words_list", self._stop_words(stops), np.int32),
        ]
        for name, (engine_name, dtype) in SAMPLING.items():
            value = _values(request, name)
            if value is not None and value.size:
                inputs.append(tensor(engine_name, [[value[0]]], dtype))
        bias = self._embedding_bias(request)
        if bias is not None:
            inputs.append(tensor("embedding_bias", bias[None], np.float32))
        return inputs

    def _embedding_bias(self, request):
        """logit_bias_ids and logit_bias_values as the engine's embedding_bias (None without them)."""
        ids, values = _values(request, "logit_bias_ids"), _values(request, "logit_bias_values")
        if ids is None and values is None:
            return None
        pairs = logit_bias([] if ids is None else ids.tolist(), [] if values is None else values.tolist(), self.vocab)
        bias = np.zeros(self.vocab, dtype=np.float32)
        for token, value in pairs:
            bias[token] = value
        return bias

    def _stop_words(self, stops):
        """[1, 2, n]: flattened ids of every stop string, then each one's end offset (-1 padded)."""
        ids, offsets = [], []
        for word in stops:
            ids += self.tokenizer.encode(word, add_special_tokens=False)
            offsets.append(len(ids))
        width = max(1, len(ids))
        flat = np.zeros(width, dtype=np.int32)
        flat[: len(ids)] = ids
        ends = np.full(width, -1, dtype=np.int32)
        ends[: len(offsets)] = offsets
        return np.stack([flat, ends])[None]

    def _response(self, text, input_tokens, output_tokens, entries=None, index=0):
        tensors = [
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("num_input_tokens", np.array([input_tokens], dtype=np.int32)),
            pb_utils.Tensor("num_output_tokens", np.array([output_tokens], dtype=np.int32)),
            pb_utils.Tensor("sequence_index", np.array([index], dtype=np.int32)),
        ]
        if entries is not None:
            encoded = json.dumps(entries).encode("utf-8")
            tensors.append(pb_utils.Tensor("log_probs", np.array([encoded], dtype=np.object_)))
        return pb_utils.InferenceResponse(output_tensors=tensors)
