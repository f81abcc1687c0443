"""Structured output for Gantry's causal-LM python model: a request's grammar
(a JSON schema, any JSON object, a regular expression or a Lark grammar)
enforced while it decodes, with llguidance.

Gantry copies this file beside causal_lm_model.py. llguidance was chosen over
xgrammar and outlines-core on this decoder's tokenizers (bench/grammars.py,
docs/performance.md): a schema compiles in well under a millisecond (xgrammar
takes milliseconds, outlines-core tens of them, and a new schema is a new
request's first token), a step's mask costs tens of microseconds like
xgrammar's, every document it let through was valid JSON (xgrammar let raw
control characters into strings), it needs nothing else installed (xgrammar
pulls in torch's triton), and TensorRT-LLM, vLLM and SGLang use it too.

The decoder (gantry_decode.Decoder) asks each constrained sequence for its
mask row between two decode steps, while the GPU runs the next forward pass,
and applies the batch's masks to the logits before sampling: the forward
passes, their CUDA graphs and the batch are the same with or without it.
"""

import llguidance
import llguidance.hf
import torch

# The guide types of TensorRT-LLM's guided decoding (guided_decoding_guide_type),
# as Gantry's generate interface takes them.
GUIDE_TYPES = ("json", "json_schema", "regex", "lark")
# JSON as OpenAI's structured output writes it: no free whitespace (an untrained
# or wandering model could otherwise pad a document with it until max_tokens).
_JSON_DEFAULTS = {"whitespace_flexible": False}
_ANY_JSON_OBJECT = {"type": "object"}


class GuideError(ValueError):
    """A grammar llguidance refuses, in its words."""


class Vocabulary:
    """A checkpoint's tokenizer as llguidance reads it, made once per model;
    ``None`` where the tokenizer cannot be constrained (not byte level or byte
    fallback: WordPiece's decoded text is not its tokens' bytes joined)."""

    def __init__(self, tokenizer, vocab: int, eos_ids) -> None:
        self.vocab = vocab
        self.words = 0
        self.tokenizer = None
        self.reason = ""
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=sorted(eos_ids) or None)
        except Exception as exc:  # noqa: BLE001 - llguidance refuses tokenizers it cannot map to bytes
            self.reason = f"this checkpoint's tokenizer cannot be constrained ({type(exc).__name__}: {exc})"
        self.words = (vocab + 31) // 32

    def guide(self, kind: str, text: str) -> "Guide":
        """A fresh matcher for one sequence; GuideError names what is wrong."""
        if self.tokenizer is None:
            raise GuideError(self.reason)
        if kind not in GUIDE_TYPES:
            raise GuideError(f"guided_decoding_guide_type must be one of {', '.join(GUIDE_TYPES)}")
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(_ANY_JSON_OBJECT, defaults=_JSON_DEFAULTS)
            elif kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_DEFAULTS)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(text)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(text)
        except Exception as exc:  # noqa: BLE001 - llguidance's words for a grammar it cannot read
            raise GuideError(str(exc)) from None
        # The matcher compiles the grammar once and keeps its errors (validate_grammar
        # would compile it a second time: 0.2 ms of a request's first token).
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise GuideError(matcher.get_error().strip())
        return Guide(matcher)


class Guide:
    """One sequence's grammar as it decodes."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def take(self, token: int) -> None:
        """The sampled token; GuideError if the grammar did not allow it."""
        if not self.matcher.consume_token(token):
            raise GuideError(self.matcher.get_error() or f"token {token} is not allowed here")

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (not even end of text)."""
        return self.matcher.is_stopped()


class Masks:
    """The batch's bitmask rows (int32 words: token 32w+b is bit b of word w), filled
    on the host (pinned memory on a GPU) for the constrained rows by llguidance's
    thread pool at once, and applied to the logits on their device with buffers made
    once (docs/performance.md). (llguidance.torch is
    not imported: it compiles a kernel with torch.compile when imported, which
    pulls in all of inductor.)"""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        words = (vocab + 31) // 32
        self.host = torch.full((rows, words), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.words = torch.empty((rows, words), dtype=torch.int32, device=device)
        self.index = torch.empty(rows * words * 4, dtype=torch.int32, device=device)
        self.penalty = torch.empty((rows * words * 4, 8), dtype=torch.float32, device=device)
        self.table = torch.where(_blocked(device), float("-inf"), 0.0)
        self.executor = llguidance.LLExecutor()

    def fill(self, guides: list[tuple["Guide", int]]) -> None:
        """The rows of ``guides`` (guide, row) for their next token; other rows are left as they are."""
        words = self.host.shape[1]
        if len(guides) == 1:
            guide, row = guides[0]
            guide.matcher.unsafe_compute_mask_ptr(self.host[row].data_ptr(), words * 4)
        elif guides:
            matchers = [(guide.matcher, row) for guide, row in guides]
            self.executor.unsafe_compute_mask_ptr(matchers, self.host.data_ptr(), words * 4, self.host.shape[0])

    def take(self, taken: list[tuple["Guide", int]]) -> None:
        """Each guide's sampled token, consumed by llguidance's thread pool at once (one by
        one, 32 rows cost a third of a millisecond); GuideError for one the grammar did not allow."""
        if len(taken) == 1:
            taken[0][0].take(taken[0][1])
            return
        results = self.executor.consume_token_par([(guide.matcher, token) for guide, token in taken])
        for (guide, token), consumed in zip(taken, results, strict=True):
            if not consumed:
                raise GuideError(guide.matcher.get_error() or f"token {token} is not allowed here")

    def open(self, rows) -> None:
        """Every token allowed in ``rows`` (unconstrained rows)."""
        self.host[rows] = -1

    def apply(self, logits: torch.Tensor) -> None:
        """Make -inf, in place, the logits (the first rows of the batch) of the tokens the
        rows do not allow. Each byte of a row picks its eight tokens' additions (0 or
        -inf) from a table of 256 in one gather, and the logits take them in one add:
        unpacking bit by bit made a 32-times-wider tensor, and a CPU's masked_fill is
        twenty times slower than its add."""
        rows, vocab = logits.shape
        words = self.words[:rows]
        words.copy_(self.host[:rows], non_blocking=True)
        index = self.index[: words.numel() * 4]
        index.copy_(words.view(torch.uint8).reshape(-1))
        penalty = self.penalty[: index.numel()]
        torch.index_select(self.table, 0, index, out=penalty)
        logits.add_(penalty.view(rows, -1)[:, :vocab])


_BLOCKED: dict = {}


def _blocked(device: torch.device) -> torch.Tensor:
    """(256, 8) bool: bit b of byte value v is clear."""
    table = _BLOCKED.get(device)
    if table is None:
        values = torch.arange(256, dtype=torch.int32)[:, None] >> torch.arange(8, dtype=torch.int32)
        table = _BLOCKED[device] = ((values & 1) == 0).to(device)
    return table


def allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The boolean (rows, vocab) view of packed bitmask rows (tests and benchmarks)."""
    return ~_blocked(bitmask.device)[bitmask.view(torch.uint8).long()].view(bitmask.shape[0], -1)[:, :vocab]
