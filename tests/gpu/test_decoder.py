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


def test_constrained_rows_share_the_batch_and_the_graphs_with_free_ones(tmp_path) -> None:  # noqa: ANN001
    """A JSON schema's rows and free rows decode in one batch on the GPU, every decode
    step a graph replay: the masks are applied outside the graphs."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.gpu.control_plane import TOKENIZER
    from tests.unit.triton_server.test_decode_extras import SCHEMA, Asked, gantry_grammar, run
    from workers.untrained import make_untrained_llm

    folder = make_untrained_llm(tmp_path / "llm", tokenizer="bpe", tokenizer_dir=TOKENIZER)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to("cuda").eval()
    decoder = gantry_decode.Decoder(model, max_batch=8, max_len=512, pad_id=tokenizer.pad_token_id)
    decoder.warm_up()
    vocabulary = gantry_grammar.Vocabulary(tokenizer, decoder.vocab, {tokenizer.eos_token_id})
    ids = tokenizer.encode("<|im_start|>user\nWho?<|im_end|>\n<|im_start|>assistant\n")
    schema = json.dumps(SCHEMA)
    guided = [
        Asked(ids, max_tokens=120, temperature=1.0, seed=s, guide=vocabulary.guide("json_schema", schema))
        for s in range(4)
    ]
    free = [Asked(ids, max_tokens=100, temperature=1.0, seed=10 + s, logprobs=2) for s in range(4)]
    batches, replays = [], []
    step, replay = decoder.step, torch.cuda.CUDAGraph.replay
    decoder.step = lambda: (batches.append(len(decoder.rows)), step())[1]
    torch.cuda.CUDAGraph.replay = lambda graph: (replays.append(graph), replay(graph))[1]
    try:
        run(decoder, guided + free)
    finally:
        torch.cuda.CUDAGraph.replay = replay
    assert decoder.mode.endswith("CUDA graphs"), decoder.mode
    assert batches[0] == 8, "constrained and free rows decode in one batch"
    decode_graphs = {id(graph) for graph in decoder.graphs.values()}
    assert sum(id(graph) in decode_graphs for graph in replays) == len(batches), "every decode step replays a graph"
    for request in guided:
        answer = json.loads(tokenizer.decode(request.output, skip_special_tokens=True))
        assert set(answer) == {"name", "age", "colour"}
    assert all(len(r.output) == 100 and all(lp is not None for lp in r.logprobs_seen) for r in free)
