"""The causal-LM model's decoder (python_models/gantry_decode.py) on the CPU,
against transformers' own generate on the same untrained weights: the slot
cache with sequences joining and leaving at different steps, chunked prefill,
waves for a sliding-window model, and per-request sampling."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from triton_server.repository import PYTHON_MODELS

sys.path.insert(0, str(PYTHON_MODELS))
import gantry_decode  # noqa: E402

VOCAB = 101


@dataclass(eq=False)
class Request(gantry_decode.Settings):
    prompt_ids: list[int]
    max_tokens: int = 12
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    random: random.Random | None = None
    output: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.seed is not None:
            self.random = random.Random(self.seed)


def llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    values = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    values.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**values)).eval()


def prompt(seed: int, length: int) -> list[int]:
    return [random.Random(seed * 7 + i).randrange(3, VOCAB) for i in range(length)]


def generate(model, request: Request) -> list[int]:
    """transformers' own greedy decoding of one prompt, unbatched."""
    ids = torch.tensor([request.prompt_ids], device=model.device)
    kwargs = {"repetition_penalty": request.repetition_penalty} if request.repetition_penalty != 1.0 else {}
    out = model.generate(
        ids, max_new_tokens=request.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs
    )
    return out[0, len(request.prompt_ids) :].tolist()


def serve(decoder, arrivals: dict[int, list[Request]]) -> None:
    """Run the decoder as the python model does: requests join at the step their
    arrival names, and leave after max_tokens."""
    step, waiting = 0, []
    while True:
        waiting += arrivals.pop(step, [])
        if waiting and decoder.room:
            joining, waiting = waiting[: decoder.room], waiting[decoder.room :]
            waiting = decoder.admit(joining) + waiting
        if not decoder.rows and not arrivals and not waiting:
            return
        done = []
        if decoder.rows:
            for request, token, _ in decoder.step():
                request.output.append(token)
                if len(request.output) >= request.max_tokens:
                    done.append(request)
        decoder.release(done)
        step += 1


def decoder_for(model, **overrides) -> gantry_decode.Decoder:
    values = {"max_batch": 4, "max_len": model.config.max_position_embeddings, "pad_id": 0}
    values.update(overrides)
    return gantry_decode.Decoder(model, **values)


def test_greedy_tokens_match_generate_as_sequences_join_and_leave_the_batch() -> None:
    model = llama()
    decoder = decoder_for(model)
    assert decoder.cache is not None and decoder.mode.startswith("slot KV cache")
    requests = [Request(prompt(i, 3 + 5 * i), max_tokens=4 + 3 * i) for i in range(6)]
    # Two arrive together, others join mid-decode (one more than the batch holds, so it waits).
    serve(decoder, {0: requests[:2], 2: requests[2:5], 3: requests[5:]})
    for request in requests:
        assert request.output == generate(model, request)
    assert decoder.rows == [] and decoder.room == 4


class Bucketed(gantry_decode.Decoder):
    """Prefills at the bucketed sizes a GPU's graphs run at, without graphs."""

    def _padded(self, rows: int, longest: int) -> tuple[int, int]:
        return gantry_decode._bucket(rows, self.max_batch), gantry_decode._width(longest, 16)


def test_bucketed_prefills_pad_rows_into_the_scratch_slot_and_match_generate() -> None:
    """On a GPU prefills run at bucketed sizes (to replay a graph per bucket): rows
    beyond the group write the scratch slot, columns beyond the longest prompt are pads."""
    model = llama()
    decoder = Bucketed(model, max_batch=8, max_len=256, pad_id=0)
    assert decoder._padded(3, 17) == (4, 32)
    requests = [Request(prompt(i, 3 + 6 * i), max_tokens=4 + 3 * i) for i in range(7)]
    serve(decoder, {0: requests[:3], 2: requests[3:]})
    for request in requests:
        assert request.output == generate(model, request)


def test_a_prompt_longer_than_a_prefill_pass_is_prefilled_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gantry_decode, "PREFILL_TOKENS", 16)
    model = llama()
    requests = [Request(prompt(1, 50), max_tokens=6), Request(prompt(2, 7), max_tokens=6)]
    serve(decoder_for(model), {0: requests})
    for request in requests:
        assert request.output == generate(model, request)


def test_repetition_penalty_matches_generate() -> None:
    model = llama()
    requests = [Request(prompt(3, 6), max_tokens=10, repetition_penalty=1.8), Request(prompt(4, 9), max_tokens=10)]
    serve(decoder_for(model), {0: requests})
    for request in requests:
        assert request.output == generate(model, request)


def test_a_seed_gives_the_same_tokens_whatever_runs_beside_it() -> None:
    model = llama()
    settings = {"max_tokens": 16, "temperature": 0.9, "top_p": 0.9, "top_k": 20}
    alone = Request(prompt(5, 8), seed=11, **settings)
    serve(decoder_for(model), {0: [alone]})
    crowd = [Request(prompt(5, 8), seed=11, **settings)] + [Request(prompt(i, 4), temperature=1.0) for i in range(3)]
    serve(decoder_for(model), {0: crowd[1:], 1: crowd[:1]})
    assert crowd[0].output == alone.output
    other = Request(prompt(5, 8), seed=12, **settings)
    serve(decoder_for(model), {0: [other]})
    assert other.output != alone.output


def test_top_k_of_one_is_greedy_and_top_p_keeps_only_the_likeliest() -> None:
    model = llama()
    greedy = Request(prompt(6, 5), max_tokens=8)
    top_k = Request(prompt(6, 5), max_tokens=8, temperature=1.5, top_k=1, seed=1)
    top_p = Request(prompt(6, 5), max_tokens=8, temperature=1.0, top_p=1e-6, seed=2)
    serve(decoder_for(model), {0: [greedy, top_k, top_p]})
    assert top_k.output == greedy.output == top_p.output


def test_sampling_follows_the_distribution() -> None:
    """Many one-token draws at temperature 1 land on tokens about as often as softmax says."""
    model = llama(vocab_size=8)
    prompt = [1, 2, 3]
    expected = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    decoder = decoder_for(model, max_batch=8)
    counts = torch.zeros(8)
    for round_ in range(100):
        requests = [Request(prompt, max_tokens=1, temperature=1.0, seed=round_ * 8 + i) for i in range(8)]
        serve(decoder, {0: requests})
        for request in requests:
            counts[request.output[0]] += 1
    assert (counts / counts.sum() - expected).abs().max() < 0.05


def test_a_sliding_window_model_decodes_in_waves_and_matches_generate() -> None:
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=8,
    )
    model = MistralForCausalLM(config).eval()
    decoder = decoder_for(model)
    assert decoder.cache is None and decoder.mode.startswith("waves")
    requests = [Request(prompt(i, 4 + 6 * i), max_tokens=5 + 4 * i) for i in range(3)]
    serve(decoder, {0: requests[:2], 1: requests[2:]})
    for request in requests:
        assert request.output == generate(model, request)


def test_a_model_whose_output_the_slot_cache_would_change_decodes_in_waves() -> None:
    class Shifted(LlamaForCausalLM):
        """A model that reads the cache's length as its positions (as some remote code does)."""

        def forward(self, input_ids=None, past_key_values=None, **kwargs):  # noqa: ANN001, ANN003
            if past_key_values is not None and past_key_values.get_seq_length():
                kwargs.pop("position_ids", None)
                kwargs.pop("attention_mask", None)
            return super().forward(input_ids=input_ids, past_key_values=past_key_values, **kwargs)

    torch.manual_seed(0)
    model = Shifted(llama().config).eval()
    assert decoder_for(model).cache is None


def test_a_request_at_the_end_of_the_context_is_refused_rather_than_written_past_it() -> None:
    model = llama(max_position_embeddings=16)
    decoder = decoder_for(model)
    request = Request(prompt(1, 10), max_tokens=20)
    decoder.admit([request])
    with pytest.raises(RuntimeError, match="context of 16 tokens"):
        for _ in range(20):
            decoder.step()
