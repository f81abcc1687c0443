"""The causal-LM decoder (python_models/gantry_decode.py) on the GPU: its CUDA
graphs (decode steps and prefills) are captured and replay exactly what the
eager passes compute, and its greedy tokens match transformers' own generate
while sequences join and leave.
The CPU checks of the same decoder are tests/unit/triton_server/test_decode.py."""

from __future__ import annotations

import pytest
import torch

from tests.unit.triton_server.test_decode import Bucketed, Request, gantry_decode, generate, llama, prompt, serve

pytestmark = pytest.mark.gpu


def _arrivals(requests: list[Request]) -> dict[int, list[Request]]:
    return {0: requests[:3], 2: requests[3:6], 5: requests[6:]}


def test_greedy_tokens_on_the_gpu_match_generate_with_graphs_captured() -> None:
    model = llama(hidden_size=256, intermediate_size=512, num_hidden_layers=4).to("cuda")
    decoder = gantry_decode.Decoder(model, max_batch=8, max_len=256, pad_id=0)
    decoder.warm_up()
    assert decoder.mode.endswith("CUDA graphs"), decoder.mode
    requests = [Request(prompt(i, 3 + 7 * i), max_tokens=5 + 4 * i) for i in range(9)]
    serve(decoder, _arrivals(requests))
    assert decoder.graphs and decoder.prefill_graphs and decoder.mode.endswith("CUDA graphs"), decoder.mode
    for request in requests:
        assert request.output == generate(model, request)


def test_graph_replays_give_the_eager_passes_tokens_in_16_bits() -> None:
    model = llama(hidden_size=256, intermediate_size=512, num_hidden_layers=4).to("cuda", torch.bfloat16)
    outputs = []
    for graphs in (True, False):  # the eager side prefills at the same (bucketed) sizes
        kind = gantry_decode.Decoder if graphs else Bucketed
        decoder = kind(model, max_batch=8, max_len=256, pad_id=0, graphs=graphs)
        requests = [
            Request(prompt(i, 4 + 5 * i), max_tokens=6 + 3 * i, temperature=0.8, top_p=0.95, seed=i) for i in range(9)
        ]
        serve(decoder, _arrivals(requests))
        assert bool(decoder.graphs) == bool(decoder.prefill_graphs) == graphs
        outputs.append([r.output for r in requests])
    assert outputs[0] == outputs[1]
