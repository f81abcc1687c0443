"""Triton python-backend model: text generation from a HuggingFace causal-LM
checkpoint (whatever transformers' AutoModelForCausalLM loads from a folder).

Gantry copies this file to <repository>/<model>/1/model.py, with gantry_decode.py,
gantry_grammar.py, gantry_send.py and gantry_text.py beside it. Its inputs and outputs are those of the
TensorRT-LLM route's generate model, so every door treats both alike:
text_input and max_tokens in; optional temperature, top_p, top_k, random_seed,
repetition_penalty, stop_words and stream; text_output out (one response per
new piece of text when streaming, else one), with num_input_tokens and
num_output_tokens (the tokens this response adds) so callers can count usage.

Beyond the engine route's interface it takes presence_penalty and
frequency_penalty (OpenAI's), logit_bias_ids with logit_bias_values, a grammar
(guided_decoding_guide_type json, json_schema, regex or lark, and
guided_decoding_guide, as TensorRT-LLM names them; gantry_grammar.py),
num_return_sequences (that many sequences of one prompt, sampled in the same
batch, each response naming its sequence_index) and return_log_probs with
top_log_probs (each response's log_probs: a JSON list, one entry per token it
adds, of the token's text, bytes, log-probability and the top alternatives').

The model is decoupled. execute() only queues requests; one generation thread
runs a gantry_decode.Decoder, which batches them continuously (requests join
and leave between decode steps) over a static KV cache and, on a GPU, CUDA
graphs. Each request keeps its own sampling settings and random stream. Its
responses leave on sender threads (gantry_send.py), so a send's round trip to
Triton's core never holds up a step; a request whose client went away (asked
there every 50 ms) stops there.

Its memory is bounded by what Gantry planned for it (deployments/gpu_plan.py):
at most max_num_sequences sequences generate at once, each of at most
max_seq_len tokens (prompt and output); their KV cache is allocated once, at
load, inside this process's cap, so a cache too large for the placement fails
the load rather than a request. Text is sent as it becomes certain
(gantry_text.TextStream).

Parameters (config.pbtxt): checkpoint_path, max_num_sequences, max_seq_len,
dtype (auto: bfloat16 or float16 on a GPU, float32 on a CPU),
trust_remote_code, and on a GPU instance gpu_memory_fraction, which caps this
process's PyTorch allocations on that GPU.
"""

import gc
import json
import queue
import random
import threading
import time

import torch
import transformers
import triton_python_backend_utils as pb_utils
from gantry_decode import MAX_TOP_LOGPROBS, Decoder, Settings
from gantry_send import Piece, Request, Sender
from gantry_text import TextStream, TokenTexts, logit_bias
from transformers import AutoModelForCausalLM, AutoTokenizer

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Decoding in waves (no slot cache), how long a wave waits for more requests after its
# first arrives (seconds): concurrent clients rarely arrive in the same microsecond.
WAVE_GATHER_S = 0.002
# The KV cache's use, told to Triton's metrics at most this often (seconds).
KV_TELL_EVERY_S = 0.5
KV_METRIC = "gantry_kv_cache_tokens"
# The requests it holds, waiting for a slot or generating: what a draining replica's host
# waits on (triton_server.metrics.in_flight), since Triton's pending count lets go of a
# decoupled request once execute() returns.
IN_FLIGHT_METRIC = "gantry_requests_in_flight"
# The most sequences one request may ask for (OpenAI's n).
MAX_RETURN_SEQUENCES = 16

try:
    import gantry_grammar
except ImportError as exc:  # llguidance missing on this host: structured output is refused, nothing else
    gantry_grammar, GRAMMAR_MISSING = None, f"structured output needs llguidance on the host ({exc})"


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


def _floats(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return [] if tensor is None else tensor.as_numpy().reshape(-1).tolist()


def sequences(request, model):
    """The sequences a request asks for (num_return_sequences of them), checked;
    ValueError names what is wrong."""
    count = _scalar(request, "num_return_sequences", 1, int)
    if not 1 <= count <= MAX_RETURN_SEQUENCES:
        raise ValueError(f"num_return_sequences must be 1 to {MAX_RETURN_SEQUENCES}")
    seed = _scalar(request, "random_seed", None, int)
    owner = Request(request, count, model.sender)
    first = _Sequence(request, model, owner, 0, seed)
    found = [first] + [first.sibling(index, seed) for index in range(1, count)]
    owner.watch()  # checked: only now may its lane ask after it (a refused one is answered and gone)
    return found


class _Sequence(Settings):
    """One sequence being generated: its prompt, settings, and what it has produced so far."""

    def __init__(self, request, model, owner, index, seed):
        tokenizer, context_len = model.tokenizer, model.context_len
        self.owner, self.index, self.tokenizer = owner, index, tokenizer
        prompt = _scalar(request, "text_input", "", str)
        self.max_tokens = _scalar(request, "max_tokens", 16, int)
        self.temperature = _scalar(request, "temperature", 1.0, float)
        self.top_p = _scalar(request, "top_p", 1.0, float)
        self.top_k = _scalar(request, "top_k", 0, int)
        self.repetition_penalty = _scalar(request, "repetition_penalty", 1.0, float)
        self.presence_penalty = _scalar(request, "presence_penalty", 0.0, float)
        self.frequency_penalty = _scalar(request, "frequency_penalty", 0.0, float)
        self.stream = _scalar(request, "stream", False, bool)
        self.stops = [s for s in _strings(request, "stop_words") if s]
        self.random = None if seed is None else random.Random(seed)
        if not prompt:
            raise ValueError("text_input is empty")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.repetition_penalty <= 0:
            raise ValueError("temperature >= 0, 0 < top_p <= 1, top_k >= 0 and repetition_penalty > 0")
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            raise ValueError("presence_penalty and frequency_penalty must be -2 to 2")
        self.logit_bias = logit_bias(
            _floats(request, "logit_bias_ids"), _floats(request, "logit_bias_values"), model.decoder.vocab
        )
        if _scalar(request, "return_log_probs", False, bool):
            self.logprobs = _scalar(request, "top_log_probs", 0, int)
            if not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
                raise ValueError(f"top_log_probs must be 0 to {MAX_TOP_LOGPROBS}")
        self.grammar = (_scalar(request, "guided_decoding_guide_type", "", str),
                        _scalar(request, "guided_decoding_guide", "", str))  # fmt: skip
        self.guide = model.guide(*self.grammar) if self.grammar[0] else None
        # Tokenized as the engine path's preprocessing does (with the tokenizer's
        # special tokens); a chat template, if any, was applied by the caller.
        self.prompt_ids = tokenizer.encode(prompt)
        if not self.prompt_ids:
            raise ValueError("text_input has no tokens")
        if len(self.prompt_ids) + self.max_tokens > context_len:
            # Gantry's client knows this refusal by "exceed the model's context" (triton_server/client.py).
            raise ValueError(
                f"the prompt's {len(self.prompt_ids)} tokens plus max_tokens {self.max_tokens} exceed "
                f"the model's context of {context_len} tokens"
            )
        self.model = model
        self._start()

    def sibling(self, index, seed):
        """Another sequence of the same request and prompt (checked once), with a random stream of its own."""
        other = object.__new__(_Sequence)
        other.__dict__.update(self.__dict__)
        other.index = index
        other.random = None if seed is None else random.Random(f"{seed}/{index}")
        other.guide = self.model.guide(*self.grammar) if self.grammar[0] else None
        other._start()
        return other

    def _start(self):
        self.output_ids = []
        self.counted = 0  # output tokens already reported
        self.token_logprobs = []  # entries not reported yet
        self.text = TextStream(self.tokenizer, self.stops)
        self.done = False

    def respond(self, text, final):
        """Queue a response with ``text`` and what it adds (gantry_send: it leaves on a sender thread)."""
        entries, self.token_logprobs = (self.token_logprobs, []) if self.logprobs is not None else (None, [])
        piece = Piece(text, len(self.prompt_ids), len(self.output_ids) - self.counted, self.index, entries)
        self.counted = len(self.output_ids)
        self.owner.send(piece, last_of_sequence=final)

    def fail(self, message):
        if not self.done:
            self.done = True
            self.owner.fail(message)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        checkpoint = _parameter(config, "checkpoint_path", None)
        if checkpoint is None:
            raise pb_utils.TritonModelException("parameter checkpoint_path is missing")
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("this model streams: its config must be decoupled")
        max_batch = max(1, int(_parameter(config, "max_num_sequences", "8")))
        trust = _parameter(config, "trust_remote_code", "false") == "true"
        if args.get("model_instance_kind") == "GPU":
            device_id = int(args["model_instance_device_id"])
            fraction = float(_parameter(config, "gpu_memory_fraction", "0.1"))
            torch.cuda.set_per_process_memory_fraction(fraction, device=device_id)
            self.device = torch.device(f"cuda:{device_id}")
            torch.cuda.set_device(self.device)
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
        positions = int(getattr(model_config, "max_position_embeddings", 0) or 2048)
        self.context_len = int(_parameter(config, "max_seq_len", str(positions)))
        eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = getattr(model_config, "eos_token_id", None)
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        pad = self.tokenizer.pad_token_id
        pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)
        self.decoder = Decoder(
            self.model, max_batch=max_batch, max_len=self.context_len, pad_id=pad_id, log=pb_utils.Logger.log_info
        )
        self.decoder.warm_up()
        self.vocabulary = None  # gantry_grammar.Vocabulary, made when a request first brings a grammar
        self.token_texts = TokenTexts(self.tokenizer)
        self.kv_used, self.kv_told_at = self._kv_gauges(args, max_batch * self.context_len), 0.0
        self.pending = queue.Queue()
        self.stopping = threading.Event()
        self.sender = Sender(pb_utils.Logger.log_error)
        # torch, transformers and the model are ~400 000 objects the collector walked in
        # every full collection: a 100-250 ms stall of the generation thread, seen as a
        # run of slow first tokens. They live as long as the process: out of its reach.
        gc.collect()
        gc.freeze()
        self.worker = threading.Thread(target=self._loop, name="gantry-generate", daemon=True)
        self.worker.start()
        pb_utils.Logger.log_info(
            f"causal LM {checkpoint} on {self.device} as {dtype}, up to {max_batch} sequences at once, "
            f"context {self.context_len}: {self.decoder.mode} "
            f"(torch {torch.__version__}, transformers {transformers.__version__})"
        )

    def _kv_gauges(self, args, capacity):
        """gantry_kv_cache_tokens{model, model_instance, kind}: the cache's capacity once, and
        its use (the tokens its sequences hold) as it changes, on Triton's metrics port."""
        family = pb_utils.MetricFamily(
            name=KV_METRIC,
            description="Tokens the model's KV cache holds (kind=used) and can hold (kind=capacity)",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        labels = {"model": args["model_name"], "model_instance": args.get("model_instance_name", "")}
        family.Metric(labels={**labels, "kind": "capacity"}).set(capacity)
        used = family.Metric(labels={**labels, "kind": "used"})
        used.set(0)
        held = pb_utils.MetricFamily(
            name=IN_FLIGHT_METRIC,
            description="Requests the model holds: waiting for a slot or generating",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self.in_flight = held.Metric(labels=labels)
        self.in_flight.set(0)
        self.kv_family, self.held_family = family, held  # the metrics live as long as their family
        return used

    def _tell_use(self, waiting):
        """The cache's use and the requests held, every KV_TELL_EVERY_S while it generates."""
        now = time.monotonic()
        if now - self.kv_told_at >= KV_TELL_EVERY_S:
            self.kv_told_at = now
            self.kv_used.set(sum(self.decoder.lengths))
            self.in_flight.set(len(self.decoder.rows) + len(waiting) + self.pending.qsize())

    def guide(self, kind, text):
        """A grammar's matcher for one sequence (gantry_grammar.Guide); ValueError if refused."""
        if gantry_grammar is None:
            raise ValueError(GRAMMAR_MISSING)
        if self.vocabulary is None:
            self.vocabulary = gantry_grammar.Vocabulary(self.tokenizer, self.decoder.vocab, self.eos_ids)
        try:
            return self.vocabulary.guide(kind, text)
        except gantry_grammar.GuideError as exc:
            raise ValueError(f"guided_decoding_guide: {exc}") from None

    def execute(self, requests):
        for request in requests:
            try:
                for sequence in sequences(request, self):
                    self.pending.put(sequence)
            except ValueError as exc:
                sender = request.get_response_sender()
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)
        return None

    # --- the generation thread --------------------------------------------------------

    def _take(self, block, room):
        """Requests waiting to join, up to ``room``; waits for the first only when idle.
        With the slot cache it waits for no more after it: one that comes a moment later
        joins at the next step (the batch is continuous), so waiting would only hold the
        first token back. Decoding in waves, a late one would wait for the whole wave:
        there it gathers WAVE_GATHER_S after the first."""
        taken, gather = [], WAVE_GATHER_S if self.decoder.cache is None else 0.0
        while len(taken) < room:
            try:
                if block and not taken:
                    taken.append(self.pending.get(timeout=0.1))
                    deadline = time.monotonic() + gather
                else:
                    wait = max(0.0, deadline - time.monotonic()) if block else 0.0
                    taken.append(self.pending.get(timeout=wait) if wait else self.pending.get_nowait())
            except queue.Empty:
                break
        return taken

    def _loop(self):
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        decoder, waiting = self.decoder, []
        while not self.stopping.is_set():
            joining = []
            try:
                room = decoder.room
                if room:
                    idle = not decoder.rows and not waiting
                    waiting += self._take(block=idle, room=room - len(waiting))
                    joining, waiting = waiting[:room], waiting[room:]
                    if joining:
                        waiting = decoder.admit(joining) + waiting
                if not decoder.rows:
                    if self.kv_told_at and not waiting:
                        self.kv_used.set(0)
                        self.in_flight.set(self.pending.qsize())
                        self.kv_told_at = 0.0
                    continue
                for sequence, token, logprobs in decoder.step():
                    self._advance(sequence, token, logprobs)
                decoder.release([s for s in decoder.rows if s.done])
                self._tell_use(waiting)
            except Exception as exc:  # noqa: BLE001 - every request in the batch gets the error
                pb_utils.Logger.log_error(f"generation failed: {exc}")
                for sequence in {id(s): s for s in decoder.rows + joining}.values():
                    sequence.fail(f"generation failed: {exc}")
                decoder.reset()

    def _advance(self, sequence, token, logprobs):
        """Record one generated token; send the text that is now certain; finish on
        end of sequence, a stop string, a complete grammar, max_tokens, or a client
        that went away."""
        made = len(sequence.output_ids)
        owner = sequence.owner
        if owner.closed or owner.cancelled:
            sequence.done = True
            if not owner.closed:
                owner.cancel()
                pb_utils.Logger.log_info(f"request cancelled by its client after {made} tokens")
            return
        finished = token in self.eos_ids
        piece = ""
        if not finished:
            sequence.output_ids.append(token)
            if logprobs is not None:
                chosen, top = logprobs
                entry = self.token_texts.entry(token, chosen)
                entry["top_logprobs"] = [self.token_texts.entry(i, lp) for i, lp in top]
                sequence.token_logprobs.append(entry)
            piece = sequence.text.add([token])
        finished = finished or sequence.text.stopped or len(sequence.output_ids) >= sequence.max_tokens
        finished = finished or (sequence.guide is not None and sequence.guide.stopped)
        if finished:
            sequence.done = True
            rest = sequence.text.finish()
            sequence.respond(piece + rest if sequence.stream else sequence.text.text, final=True)
        elif sequence.stream and piece:
            sequence.respond(piece, final=False)

    def finalize(self):
        self.stopping.set()
        self.worker.join(timeout=10)
        self.sender.stop()
        self.decoder = self.model = None
        gc.unfreeze()  # what initialize() set aside goes with the model
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
