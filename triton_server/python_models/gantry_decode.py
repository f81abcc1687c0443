"""Continuous batching for Gantry's causal-LM python model, with no Triton in it.

Gantry copies this file beside causal_lm_model.py (one file, over 450 lines on
purpose: Triton's python backend loads a model's helpers from its folder, and
the batch, the cache, the graphs and the sampler share one decode step). A Decoder owns one model's
running batch: requests join it (admit) between two decode steps and leave it
(release) when done, so N concurrent streams cost about one forward pass per
token instead of N, however they arrive.

transformers' own continuous batching (ContinuousBatchingManager, 5.23) was
not adopted: it samples with one global generator and has no repetition
penalty, so per-request seeds and penalties could not be honoured
(docs/performance.md). What it brings that matters here is done in this file:

- a static KV cache (SlotCache): one slot of max_len positions per sequence,
  allocated once within the placement's memory cap, written in place. A
  sequence's tokens sit at positions 0..n-1 of its slot whatever the batch, so
  joining needs no re-padding and leaving moves the last slots into the holes;
- CUDA graphs on a GPU: each decode step is one graph replay, captured once per
  (batch, attended width) bucket, so a step costs the GPU's time, not the
  Python time of launching every kernel of every layer;
- sampling on the device for the whole batch at once (repetition, presence and
  frequency penalties, logit bias, a grammar's mask, temperature, top-k, top-p;
  greedy at temperature 0), with each request's own random stream, so the same
  seed gives the same text whatever else is running;
- log-probabilities of the chosen tokens and the most likely others, from the
  model's own distribution (before penalties, bias, mask and temperature), for
  the rows that ask;
- structured output (gantry_grammar): a constrained row's mask for the next
  token is computed while the GPU runs the forward pass, and applied before
  sampling, outside the graphs, which stay the same;
- the next step's forward pass is queued before the host reads this step's
  tokens, so sending text overlaps the GPU's work.

Prompts are prefilled in groups of at most PREFILL_TOKENS padded tokens
(gpu_plan plans those activations), a longer prompt in chunks of that size,
keeping only the last position's logits. Models whose attention the slot cache
cannot serve (sliding windows, state-space layers, or any model whose output
with it differs from its own forward pass, checked once at load) decode in
waves instead: requests that arrive together are batched with the model's own
cache and left padding, and the next wave starts when the last one ends.
"""

import random

import torch
from transformers.cache_utils import Cache, DynamicCache

# The most (padded) prompt tokens one prefill forward pass takes.
PREFILL_TOKENS = 4096
# The attended width is rounded up to a power of two of at least this, so a
# sequence crosses into a new graph a handful of times, not every token.
MIN_WIDTH = 128
# Prefill graphs up to this padded prompt length are captured at load (warm_up).
WARM_PREFILL_WIDTH = 512
# The most alternatives a row may ask log-probabilities of (OpenAI's top_logprobs).
MAX_TOP_LOGPROBS = 20


class Settings:
    """What a sequence asks of sampling, with the values that change nothing: a
    row's class may inherit these and set what it needs."""

    temperature = 1.0
    top_p = 1.0
    top_k = 0
    repetition_penalty = 1.0  # on prompt and output tokens (transformers')
    presence_penalty = 0.0  # on output tokens, as OpenAI's
    frequency_penalty = 0.0
    logit_bias: tuple = ()  # (token id, added logit) pairs
    guide = None  # gantry_grammar.Guide: the grammar its tokens must follow
    logprobs = None  # None, or how many alternatives to report beside the chosen token (0..20)
    random = None  # a random.Random of its own (a seed), or None for the decoder's


class SlotCache(Cache):
    """A KV cache of fixed slots, one per sequence, each max_len positions long,
    allocated when the first layer writes (its heads and dtype are the model's).
    The last slot is scratch: padding rows of a bucketed prefill write there.

    Before each forward pass, use() names the slots (rows), where each input token
    is written (its position in the sequence) and how many positions attention
    reads: every layer scatters its new keys and values there and reads the first
    ``width`` positions back; positions a row has not reached are masked.
    use_fresh() is for prompts with nothing cached yet: the new keys and values
    are written to the slots of ``rows`` (an index tensor) and attention reads
    them as they are, so a prefill needs no slot contiguous with the batch.
    """

    def __init__(self, slots: int, max_len: int):
        super().__init__(layers=[])
        self.slots, self.max_len = slots, max_len
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows = slice(0, 0)
        self.write = None
        self.width = 0
        self.fresh = False

    @property
    def scratch(self) -> int:
        return self.slots - 1

    def use(self, rows: slice, write: torch.Tensor, width: int) -> None:
        self.rows, self.write, self.width, self.fresh = rows, write, width, False

    def use_fresh(self, rows: torch.Tensor, write: torch.Tensor) -> None:
        self.rows, self.write, self.width, self.fresh = rows, write, write.shape[1], True

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == len(self.keys):
            for store, states in ((self.keys, key_states), (self.values, value_states)):
                shape = (self.slots, states.shape[1], self.max_len, states.shape[3])
                store.append(torch.zeros(shape, dtype=states.dtype, device=states.device))
        if self.fresh:
            rows = self.rows[:, None]
            self.keys[layer_idx][rows, :, self.write] = key_states.transpose(1, 2)
            self.values[layer_idx][rows, :, self.write] = value_states.transpose(1, 2)
            return key_states, value_states
        keys, values = self.keys[layer_idx][self.rows], self.values[layer_idx][self.rows]
        index = self.write[:, None, :, None]
        keys.scatter_(2, index.expand(key_states.shape), key_states)
        values.scatter_(2, index.expand(value_states.shape), value_states)
        return keys[:, :, : self.width], values[:, :, : self.width]

    def get_seq_length(self, layer_idx=0):
        return self.width

    def __len__(self):
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def move(self, sources: list[int], targets: list[int], width: int) -> None:
        """Copy slots ``sources`` into ``targets`` (the first ``width`` positions)."""
        device = self.keys[0].device
        src, dst = torch.tensor(sources, device=device), torch.tensor(targets, device=device)
        for store in self.keys + self.values:
            store[dst, :, :width] = store[src, :, :width]


def _mask(positions: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask (rows, 1, queries, width): a query at position p
    reads the cache positions 0..p of its own slot."""
    reach = torch.arange(width, device=positions.device)[None, None, None, :] <= positions[:, None, :, None]
    return torch.zeros(reach.shape, dtype=dtype, device=positions.device).masked_fill_(~reach, torch.finfo(dtype).min)


def _fresh_mask(first_real: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask (rows, 1, width, width) of left-padded prompts: a real token
    reads the real tokens up to itself (row r's start at column first_real[r]); a pad
    reads only itself."""
    column = torch.arange(width, device=first_real.device)
    query, key = column[:, None], column[None, :]
    allowed = ((key <= query)[None] & (key[None] >= first_real[:, None, None])) | (key == query)[None]
    shape = (first_real.shape[0], 1, width, width)
    return torch.zeros(shape, dtype=dtype, device=first_real.device).masked_fill_(
        ~allowed[:, None], torch.finfo(dtype).min
    )


def _bucket(n: int, limit: int) -> int:
    """A batch size rounded up to 1, 2, 4, 8 or a multiple of 8 (at most ``limit``)."""
    size = next((b for b in (1, 2, 4, 8) if b >= n), -(-n // 8) * 8)
    return min(size, limit)


def _width(n: int, least: int) -> int:
    """A length rounded up to a power of two of at least ``least``."""
    return max(least, 1 << (n - 1).bit_length())


class Decoder:
    """One model's running batch. ``rows`` are the sequences decoding, in row order;
    each has prompt_ids and the fields of Settings."""

    def __init__(self, model, *, max_batch: int, max_len: int, pad_id: int, graphs: bool = True, log=None):
        self.model, self.max_batch, self.max_len, self.pad_id = model, max_batch, max_len, pad_id
        self.log = log or (lambda message: None)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.keep_last_logits = True
        self.random = random.Random()
        self.rows: list = []
        self.lengths: list[int] = []  # each row's next write position (its tokens so far)
        self.alive: list[bool] = []
        vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() else None
        self.vocab = vocab or model.config.vocab_size
        device, batch = self.device, max_batch
        self.logits = torch.zeros((batch, self.vocab), dtype=torch.float32, device=device)
        self.seen = torch.zeros((batch, self.vocab), dtype=torch.bool, device=device)
        self.temperature = torch.ones(batch, device=device)
        self.top_p = torch.ones(batch, device=device)
        self.top_k = torch.zeros(batch, dtype=torch.long, device=device)
        self.penalty = torch.ones(batch, device=device)
        self.presence = torch.zeros(batch, device=device)
        self.frequency = torch.zeros(batch, device=device)
        self.counts = None  # (batch, vocab) output tokens so far, once a row asks for presence or frequency penalties
        self.bias = None  # (batch, vocab) added logits, once a row brings a logit bias
        self.masks = None  # gantry_grammar.Masks, once a row brings a grammar
        self.ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((batch, 1), dtype=torch.long, device=device)
        cuda = device.type == "cuda"
        self.host_tokens = torch.zeros(batch, dtype=torch.long, pin_memory=cuda)
        self.host_uniform = torch.zeros(batch, dtype=torch.float32, pin_memory=cuda)
        self.host_logprob = torch.zeros(batch, dtype=torch.float32, pin_memory=cuda)
        self.host_top = torch.zeros((batch, MAX_TOP_LOGPROBS), dtype=torch.float32, pin_memory=cuda)
        self.host_top_ids = torch.zeros((batch, MAX_TOP_LOGPROBS), dtype=torch.long, pin_memory=cuda)
        self.copied = torch.cuda.Event() if cuda else None
        self.cache = self._slot_cache()
        graphs = cuda and graphs and self.cache is not None
        # Decode graphs by (batch, width); prefill graphs by (rows, width), with their inputs.
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] | None = {} if graphs else None
        self.prefill_graphs: dict[tuple[int, int], tuple] | None = {} if graphs else None
        self.prefill_logits = torch.zeros((batch, self.vocab), device=device) if graphs else None
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self.wave = None  # the model's own cache, when decoding in waves

    # --- what the caller sees -----------------------------------------------------

    @property
    def mode(self) -> str:
        if self.cache is None:
            return "waves (the model's own cache)"
        if self.graphs is None:
            graphs = "eager"
        else:
            graphs = "CUDA graphs" if self.prefill_graphs is not None else "CUDA graphs (decode only)"
        return f"slot KV cache of {self.cache.nbytes / 2**30:.2f} GiB, {graphs}"

    @property
    def room(self) -> int:
        """How many sequences may join now."""
        if self.cache is None and self.rows:
            return 0
        return self.max_batch - len(self.rows)

    @torch.inference_mode()
    def admit(self, sequences: list) -> list:
        """Prefill ``sequences`` (at most ``room``); they decode from the next step.
        Returns those that must wait (a wave takes one prefill group)."""
        groups = prefill_groups(sequences, self._padded)
        if self.cache is None:
            groups, waiting = groups[:1], [s for group in groups[1:] for s in group]
        else:
            waiting = []
        for group in groups:
            first = len(self.rows)
            rows = slice(first, first + len(group))
            settings = [(s.temperature, s.top_p, s.repetition_penalty) for s in group]
            settings = torch.tensor(settings, dtype=torch.float32).to(self.device)
            self.temperature[rows], self.top_p[rows], self.penalty[rows] = settings.unbind(-1)
            self.top_k[rows] = torch.tensor([s.top_k for s in group]).to(self.device)
            self.pos[rows, 0] = torch.tensor([len(s.prompt_ids) for s in group]).to(self.device)
            self.seen[rows] = False
            for row, sequence in enumerate(group, start=first):
                self.seen[row, torch.tensor(sequence.prompt_ids).to(self.device)] = True
            self._admit_extras(group, rows)
            if self.cache is None:
                self._prefill_wave(group)
            else:
                self._prefill(group, first)
            self.rows += group
            self.lengths += [len(s.prompt_ids) for s in group]
            self.alive += [True] * len(group)
        return waiting

    @torch.inference_mode()
    def step(self) -> list[tuple[object, int, tuple | None]]:
        """Each live row's next token, with its log-probability and the top
        alternatives' ((id, log-probability) pairs) where the row asks for them,
        else None; the forward pass that follows is already queued."""
        n = len(self.rows)
        if max(self.lengths) >= self.max_len:
            raise RuntimeError(f"a sequence reached the context of {self.max_len} tokens")
        rows = self.rows
        guided = [(s.guide, i) for i, s in enumerate(rows) if s.guide is not None and self.alive[i]]
        if guided:
            self.masks.open(slice(0, n))
            self.masks.fill(guided)
        wanted = [s.logprobs for s in rows]
        top = max((w or 0 for w in wanted), default=0)
        raw = torch.log_softmax(self.logits[:n], -1) if any(w is not None for w in wanted) else None
        tokens = self._sample(n, masked=bool(guided))
        arange = torch.arange(n, device=self.device)
        self.seen[arange, tokens] = True
        if self.counts is not None:
            self.counts[arange, tokens] += 1
        self.host_tokens[:n].copy_(tokens, non_blocking=True)
        if raw is not None:
            self.host_logprob[:n].copy_(raw[arange, tokens], non_blocking=True)
            if top:
                values, ids = raw.topk(top, -1)
                self.host_top[:n, :top].copy_(values, non_blocking=True)
                self.host_top_ids[:n, :top].copy_(ids, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.ids[:n, 0] = tokens
        if self.cache is None:
            self._decode_wave(n)
        else:
            self._decode_slots(n)
        self.pos[:n] += 1
        if self.copied is not None:
            self.copied.synchronize()
        chosen = self.host_tokens[:n].tolist()
        self.lengths = [length + 1 for length in self.lengths]
        if guided:
            self.masks.take([(guide, chosen[i]) for guide, i in guided])
        logprobs = [None] * n
        if raw is not None:
            chosen_lp, top_lp = self.host_logprob[:n].tolist(), self.host_top[:n].tolist()
            top_ids = self.host_top_ids[:n].tolist()
            for i, want in enumerate(wanted):
                if want is not None:
                    logprobs[i] = (chosen_lp[i], list(zip(top_ids[i][:want], top_lp[i][:want], strict=True)))
        return [(rows[i], chosen[i], logprobs[i]) for i in range(n) if self.alive[i]]

    @torch.inference_mode()
    def release(self, done: list) -> None:
        """Sequences that will take no more tokens leave the batch."""
        if not done:
            return
        leaving = {id(s) for s in done}
        if self.cache is None:
            self.alive = [a and id(s) not in leaving for a, s in zip(self.alive, self.rows, strict=True)]
            if not any(self.alive):
                self.reset()
            return
        keep = [i for i, s in enumerate(self.rows) if id(s) not in leaving]
        moves = [(source, target) for target, source in enumerate(keep) if source != target]
        if moves:
            sources, targets = [m[0] for m in moves], [m[1] for m in moves]
            self.cache.move(sources, targets, min(self.max_len, max(self.lengths[s] for s in sources) + 1))
            src, dst = torch.tensor(sources, device=self.device), torch.tensor(targets, device=self.device)
            extras = [t for t in (self.counts, self.bias) if t is not None]
            for tensor in (self.logits, self.seen, self.temperature, self.top_p, self.top_k, self.penalty,
                           self.presence, self.frequency, self.pos, *extras):  # fmt: skip
                tensor[dst] = tensor[src]
        self.rows = [self.rows[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        self.alive = [True] * len(keep)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Capture now the graphs the first requests would otherwise wait for: the
        decode step of every batch size at the shortest width, and prefills of up to
        WARM_PREFILL_WIDTH tokens (longer ones, and wider decode steps, on first use)."""
        if self.graphs is None or self.rows:
            return
        sizes = sorted({_bucket(n, self.max_batch) for n in range(1, self.max_batch + 1)})
        self.pos.zero_()
        for batch in sizes:
            if self._decode_graph(batch, min(MIN_WIDTH, self.max_len)) is None:
                return
        width = 16
        while width <= min(WARM_PREFILL_WIDTH, self.max_len):
            for rows in (rows for rows in sizes if rows * width <= PREFILL_TOKENS):
                # Every row writes the scratch slot: nothing is running yet.
                inputs = (
                    torch.full((rows, width), self.pad_id, dtype=torch.long),
                    torch.arange(width).repeat(rows, 1),
                    torch.full((rows,), self.cache.scratch, dtype=torch.long),
                    torch.zeros(rows, dtype=torch.long),
                )
                if self.prefill_graphs is None or self._prefill_graph(rows, width, inputs) is None:
                    return
            width *= 2

    def reset(self) -> None:
        """Forget every row (after an error, or when a wave ends)."""
        self.rows, self.lengths, self.alive, self.wave = [], [], [], None

    # --- sampling -----------------------------------------------------------------

    def _admit_extras(self, group: list, rows: slice) -> None:
        """What joining rows ask beyond temperature, top-p, top-k and repetition:
        presence and frequency penalties, a logit bias, a grammar (each tensor
        made when a row first needs it)."""
        device = self.device
        penalties = [(s.presence_penalty, s.frequency_penalty) for s in group]
        self.presence[rows], self.frequency[rows] = torch.tensor(penalties, dtype=torch.float32).to(device).unbind(-1)
        if self.counts is None and any(p or f for p, f in penalties):
            self.counts = torch.zeros((self.max_batch, self.vocab), dtype=torch.float32, device=device)
        if self.counts is not None:
            self.counts[rows] = 0
        if self.bias is None and any(s.logit_bias for s in group):
            self.bias = torch.zeros((self.max_batch, self.vocab), dtype=torch.float32, device=device)
        if self.bias is not None:
            self.bias[rows] = 0
            for row, sequence in enumerate(group, start=rows.start):
                if sequence.logit_bias:
                    ids, values = zip(*sequence.logit_bias, strict=True)
                    self.bias[row, torch.tensor(ids).to(device)] = torch.tensor(values).to(device)
        if self.masks is None and any(s.guide is not None for s in group):
            import gantry_grammar  # beside this file; only where a request brings a grammar

            self.masks = gantry_grammar.Masks(self.max_batch, self.vocab, self.device)

    def _sample(self, n: int, masked: bool = False) -> torch.Tensor:
        logits = self.logits[:n]
        rows = self.rows
        if any(s.repetition_penalty != 1.0 for s in rows):
            penalty = self.penalty[:n, None]
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(self.seen[:n], penalised, logits)
        if any(s.presence_penalty or s.frequency_penalty for s in rows):
            counts = self.counts[:n]
            logits = logits - self.frequency[:n, None] * counts - self.presence[:n, None] * (counts > 0)
        if any(s.logit_bias for s in rows):
            logits = logits + self.bias[:n]
        if masked:
            # In place, self.logits too: the raw log-probabilities were taken, and the next
            # forward pass writes them anew.
            self.masks.apply(logits)
        greedy = [s.temperature == 0 for s in rows]
        if all(greedy):
            return logits.argmax(-1)
        temperature = self.temperature[:n, None]
        scaled = logits / torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        order = None
        if any(s.top_k > 0 or s.top_p < 1.0 for s in rows):
            scaled, order = scaled.sort(-1, descending=True)
            rank = torch.arange(self.vocab, device=self.device)[None, :]
            top_k = self.top_k[:n, None]
            scaled = scaled.masked_fill((top_k > 0) & (rank >= top_k), float("-inf"))
            probabilities = torch.softmax(scaled, -1)
            beyond_p = probabilities.cumsum(-1) - probabilities > self.top_p[:n, None]
            scaled = scaled.masked_fill(beyond_p, float("-inf"))
        cumulative = torch.softmax(scaled, -1).cumsum(-1)
        draws = [(s.random or self.random).random() if not g else 0.0 for s, g in zip(rows, greedy, strict=True)]
        self.host_uniform[:n] = torch.tensor(draws, dtype=torch.float32)
        uniform = self.host_uniform[:n].to(self.device, non_blocking=True)
        picked = torch.searchsorted(cumulative, (uniform * cumulative[:, -1])[:, None], right=True)
        picked = picked.clamp_(max=self.vocab - 1)
        tokens = picked[:, 0] if order is None else order.gather(1, picked)[:, 0]
        if any(greedy):
            tokens = torch.where(self.temperature[:n] == 0, logits.argmax(-1), tokens)
        return tokens

    # --- the slot cache -------------------------------------------------------------

    def _forward(self, **inputs):
        """One forward pass, keeping only the last position's logits where the model
        can (a prefill's logits for every prompt token would dwarf its KV cache)."""
        if self.keep_last_logits:
            try:
                return self.model(**inputs, logits_to_keep=1)
            except TypeError:
                self.keep_last_logits = False  # a model (its own remote code) without the argument
        return self.model(**inputs)

    def _run_slots(self, ids: torch.Tensor, positions: torch.Tensor, rows: slice, width: int) -> torch.Tensor:
        """A forward pass over slots ``rows`` that reads what they hold (decode steps, prompt chunks)."""
        self.cache.use(rows, positions, width)
        outputs = self._forward(
            input_ids=ids,
            position_ids=positions,
            attention_mask=_mask(positions, width, self.dtype),
            past_key_values=self.cache,
            use_cache=True,
        )
        return outputs.logits[:, -1, :]

    def _run_fresh(self, ids, positions, rows, first_real) -> torch.Tensor:
        """A forward pass over left-padded prompts written to slots ``rows`` (an index tensor)."""
        self.cache.use_fresh(rows, positions)
        outputs = self._forward(
            input_ids=ids,
            position_ids=positions,
            attention_mask=_fresh_mask(first_real, ids.shape[1], self.dtype),
            past_key_values=self.cache,
            use_cache=True,
        )
        return outputs.logits[:, -1, :]

    def _slot_cache(self) -> SlotCache | None:
        """The slot cache, if this model's forward pass with it matches its own
        (checked on a short prompt and one decode step); else None."""
        config = self.model.config
        window = getattr(config, "sliding_window", None)
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if (window and window < self.max_len) or kinds != {"full_attention"}:
            self.log(f"attention layers {sorted(kinds)}, window {window}: decoding in waves")
            return None
        cache = SlotCache(self.max_batch + 1, self.max_len)
        device = self.device
        probe = torch.arange(5, device=device)[None, :] % self.vocab
        row, start = torch.zeros(1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device)
        try:
            with torch.inference_mode():
                self.cache = cache
                got = [self._run_fresh(probe[:, :4], torch.arange(4, device=device)[None, :], row, start)]
                got.append(self._run_slots(probe[:, 4:], torch.tensor([[4]], device=device), slice(0, 1), 5))
                want = self.model(input_ids=probe).logits[0, 3:5]
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - any model its attention does not suit
            self.log(f"the slot cache does not suit this model ({type(exc).__name__}: {exc}): decoding in waves")
            return None
        finally:
            self.cache = None
        got = torch.cat(got).float()
        scale = want.float().abs().max().clamp(min=1e-6)
        if not torch.allclose(got, want.float(), rtol=0, atol=float(scale) * 2e-2):
            self.log("the slot cache changes this model's output: decoding in waves")
            return None
        return cache

    def _padded(self, rows: int, longest: int) -> tuple[int, int]:
        """The (rows, width) a prefill of ``rows`` prompts of at most ``longest`` tokens
        runs at: bucketed where prefills replay graphs, else as they are."""
        if self.prefill_graphs is None or _width(longest, 16) > self.max_len:
            return rows, longest
        return _bucket(rows, self.max_batch), _width(longest, 16)

    def _prefill(self, group: list, first: int) -> None:
        longest = max(len(s.prompt_ids) for s in group)
        if len(group) == 1 and longest > PREFILL_TOKENS:
            self._prefill_chunks(group[0], first)
            return
        # Left-padded, so every row's last real token is the last column (one logits
        # row each). Real tokens are written at 0..len-1; pads after them, where the
        # first decode steps overwrite them and the mask hides them until then.
        # Padding rows (to the bucket) write the scratch slot.
        rows, width = self._padded(len(group), longest)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        positions = torch.arange(width).repeat(rows, 1)
        slots = torch.full((rows,), self.cache.scratch, dtype=torch.long)
        first_real = torch.zeros(rows, dtype=torch.long)
        for row, sequence in enumerate(group):
            length = len(sequence.prompt_ids)
            ids[row, width - length :] = torch.tensor(sequence.prompt_ids)
            positions[row, width - length :] = torch.arange(length)
            positions[row, : width - length] = torch.arange(length, width)
            slots[row], first_real[row] = first + row, width - length
        inputs = (ids, positions, slots, first_real)
        taken = slice(first, first + len(group))
        graph = self._prefill_graph(rows, width, inputs) if self.prefill_graphs is not None else None
        if graph is None:
            self.logits[taken] = self._run_fresh(*(t.to(self.device) for t in inputs))[: len(group)].float()
            return
        graph, buffers = graph
        for buffer, tensor in zip(buffers, inputs, strict=True):
            buffer.copy_(tensor)
        graph.replay()
        self.logits[taken] = self.prefill_logits[: len(group)]

    def _prefill_chunks(self, sequence, first: int) -> None:
        """A prompt longer than one prefill pass, PREFILL_TOKENS at a time, each chunk
        reading the ones before it from its slot."""
        length = len(sequence.prompt_ids)
        ids = torch.tensor(sequence.prompt_ids, device=self.device)[None, :]
        for start in range(0, length, PREFILL_TOKENS):
            end = min(length, start + PREFILL_TOKENS)
            positions = torch.arange(start, end, device=self.device)[None, :]
            logits = self._run_slots(ids[:, start:end], positions, slice(first, first + 1), end)
        self.logits[first] = logits[0].float()

    def _prefill_graph(self, rows: int, width: int, inputs: tuple):
        """The prefill graph of this bucket and its input buffers, captured on first use
        (with ``inputs`` in them, so its warm-up passes write what the replay will);
        None (and eager prefills from then on) if the model cannot be captured."""
        entry = self.prefill_graphs.get((rows, width))
        if entry is not None:
            return entry
        buffers = tuple(tensor.to(self.device) for tensor in inputs)

        def run() -> None:
            self.prefill_logits[:rows] = self._run_fresh(*buffers)

        try:
            graph = self._capture(run)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - any model that cannot be captured prefills eagerly
            self.log(f"prefill graphs off ({type(exc).__name__}: {exc}): prefilling eagerly")
            self.prefill_graphs = None
            return None
        self.prefill_graphs[(rows, width)] = entry = (graph, buffers)
        return entry

    def _decode_slots(self, n: int) -> None:
        batch = _bucket(n, self.max_batch)
        width = min(self.max_len, _width(max(self.lengths) + 1, MIN_WIDTH))
        if batch > n:
            self.pos[n:batch] = 0  # padding rows write position 0 of free slots
        graph = self._decode_graph(batch, width) if self.graphs is not None else None
        if graph is not None:
            graph.replay()
        else:
            self._decode_eager(batch, width)

    def _decode_eager(self, batch: int, width: int) -> None:
        self.logits[:batch] = self._run_slots(self.ids[:batch], self.pos[:batch], slice(0, batch), width)

    def _decode_graph(self, batch: int, width: int):
        """The decode step's CUDA graph for this bucket, captured on first use; None
        (and eager from then on) if the model cannot be captured."""
        graph = self.graphs.get((batch, width))
        if graph is not None:
            return graph
        try:
            graph = self._capture(lambda: self._decode_eager(batch, width))
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - any model that cannot be captured runs eagerly
            self.log(f"CUDA graphs off ({type(exc).__name__}: {exc}): decoding eagerly")
            self.graphs = self.prefill_graphs = None
            return None
        self.graphs[(batch, width)] = graph
        return graph

    def _capture(self, run) -> torch.cuda.CUDAGraph:
        """``run`` as a CUDA graph. Its warm-up passes compute exactly what the replay
        will (same inputs, same slot positions), so running it more than once changes
        nothing."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            run()
        return graph

    # --- waves: the model's own cache -------------------------------------------------

    def _prefill_wave(self, group: list) -> None:
        if self.wave is not None:
            raise RuntimeError("a wave is running")
        longest = max(len(s.prompt_ids) for s in group)
        ids = torch.full((len(group), longest), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(group), longest), dtype=torch.long)
        for row, sequence in enumerate(group):
            ids[row, longest - len(sequence.prompt_ids) :] = torch.tensor(sequence.prompt_ids)
            attention[row, longest - len(sequence.prompt_ids) :] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        outputs = self._forward(
            input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=cache, use_cache=True
        )
        self.wave = (outputs.past_key_values, attention, positions[:, -1:])
        self.logits[: len(group)] = outputs.logits[:, -1, :].float()

    def _decode_wave(self, n: int) -> None:
        cache, attention, positions = self.wave
        attention = torch.cat([attention, torch.ones((n, 1), dtype=attention.dtype, device=self.device)], -1)
        positions = positions + 1
        outputs = self._forward(
            input_ids=self.ids[:n],
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        self.wave = (outputs.past_key_values, attention, positions)
        self.logits[:n] = outputs.logits[:, -1, :].float()


def prefill_groups(sequences: list, padded=lambda rows, longest: (rows, longest)) -> list[list]:
    """Sequences in groups whose padded prompts (``padded(rows, longest)``) stay
    within PREFILL_TOKENS (a longer prompt goes alone, in chunks), shortest first so
    padding stays small."""
    groups, group = [], []
    for sequence in sorted(sequences, key=lambda s: len(s.prompt_ids)):
        rows, width = padded(len(group) + 1, len(sequence.prompt_ids))
        if group and rows * width > PREFILL_TOKENS:
            groups.append(group)
            group = []
        group.append(sequence)
    if group:
        groups.append(group)
    return groups
