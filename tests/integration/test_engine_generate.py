"""The engine path in a real tritonserver: Gantry's generated repository for an
engine placement (the tensorrt_llm model and the generate model in front of
it) loads with a test-only python model standing in for the engine (same
inputs and outputs, decoupled: TensorRT-LLM cannot run here), and text goes
through it with Triton's generate and generate_stream, Gantry's own generate
interface and the gateway, exactly as it does for the transformers path.

The streamed text must equal the whole decode for a WordPiece, a SentencePiece
and a byte-level tokenizer: decoding each response's tokens alone (what
tensorrtllm_backend's ensemble postprocessing does) drops SentencePiece's
spaces and splits multi-byte characters."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
from transformers import AutoTokenizer

from tests import factories
from tests.integration.conftest import ROOT, free_ports, wait_for
from triton_server.client import TritonClient, generate_stream
from triton_server.config import Batching, TrtllmSpec, parse_text, to_text
from triton_server.repository import write_repository
from workers.runtimes.process import ProcessRuntime
from workers.untrained import make_untrained_llm

pytestmark = pytest.mark.integration

CORPUS = ["the quick brown fox jumps over the lazy dog", "gantry serves every model on triton",
          "héllo wörld 日本語 naïve café"] * 50  # fmt: skip


def _trained_tokenizer(folder: Path, kind: str) -> Path:
    """A small tokenizer of a real kind trained here: SentencePiece-style BPE (▁ marks a
    word's start) or byte-level BPE (a character may span several tokens)."""
    from tokenizers import ByteLevelBPETokenizer, SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    if kind == "sentencepiece":
        trained = SentencePieceBPETokenizer()
        trained.train_from_iterator(CORPUS, vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                    show_progress=False)  # fmt: skip
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=trained, unk_token="<unk>", bos_token="<s>",
                                            eos_token="</s>")  # fmt: skip
    else:
        trained = ByteLevelBPETokenizer()
        trained.train_from_iterator(CORPUS, vocab_size=260, special_tokens=["<|endoftext|>"], show_progress=False)
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=trained, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)
    return folder


def _engine_folder(folder: Path, tokenizer: Path) -> Path:
    """What the generate model reads of an engine folder: config.json's vocabulary size
    (a built engine's pads the tokenizer's to a multiple of the tensor-parallel size)."""
    folder.mkdir(parents=True)
    size = len(AutoTokenizer.from_pretrained(tokenizer)) + 3  # padded, as a real engine's may be
    (folder / "config.json").write_text(json.dumps({"pretrained_config": {"vocab_size": size}}))
    return folder


def _stand_in_for_the_engine(repository: Path, spec: TrtllmSpec, drop_ids: list[int]) -> None:
    """Same config as Gantry wrote for the engine model, but run by the python
    backend with the stand-in's code (the tensorrtllm backend's parameters dropped)."""
    folder = repository / spec.engine_model
    config = parse_text((folder / "config.pbtxt").read_text())
    config.backend = "python"
    config.ClearField("parameters")
    config.parameters["step_delay_s"].string_value = "0.05"
    config.parameters["drop_ids"].string_value = ",".join(map(str, drop_ids))
    (folder / "config.pbtxt").write_text(to_text(config))
    shutil.copyfile(ROOT / "tests/fixtures/engine_standin_model.py", folder / "1" / "model.py")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """One server with an engine placement per tokenizer kind: llm (WordPiece, the
    untrained Llama's), sp (SentencePiece) and bytes (byte-level)."""
    tmp_path = tmp_path_factory.mktemp("engine")
    tokenizers = {
        "llm": make_untrained_llm(tmp_path / "tiny-llama"),
        "sp": _trained_tokenizer(tmp_path / "sp", "sentencepiece"),
        "bytes": _trained_tokenizer(tmp_path / "bytes", "bytelevel"),
    }
    # sp's engine model is a release's without num_return_sequences (0.12's); the others' take it.
    specs = [
        TrtllmSpec(name=name, engine_dir=str(_engine_folder(tmp_path / f"{name}-engine", folder)),
                   tokenizer_dir=str(folder), batching=Batching(max_batch_size=8), gpu_device_ids=(0,),
                   num_return_sequences=name != "sp")
        for name, folder in tokenizers.items()
    ]  # fmt: skip
    repository = tmp_path / "deployment" / "repository"
    write_repository(repository, specs)
    for spec, folder in zip(specs, tokenizers.values(), strict=True):
        _stand_in_for_the_engine(repository, spec, AutoTokenizer.from_pretrained(folder).all_special_ids)
    record = tmp_path / "engine-requests.jsonl"
    port = free_ports(3)
    launch = factories.launch_spec(
        tmp_path / "deployment",
        models=[name for spec in specs for name in spec.model_names],
        http_port=port, grpc_port=port + 1, metrics_port=port + 2,
        extra_env={"GANTRY_STANDIN_RECORD": str(record)},  # read by the stand-in inside the server
    )  # fmt: skip
    runtime = ProcessRuntime(tmp_path / "data")
    handle = runtime.start(launch)
    try:
        client = TritonClient(f"127.0.0.1:{port}")
        client.wait_until_ready(launch.models, timeout_s=120, keep_waiting=lambda: runtime.is_running(handle, launch))
        client.close()
        yield f"127.0.0.1:{port}", record, tokenizers
    finally:
        runtime.stop(handle, launch)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _mine(path: Path, before: int, match: Callable[[dict], bool]) -> dict | None:
    """The first record since `before` that this test's request wrote."""
    return next((r for r in _records(path)[before:] if match(r)), None)


def _stream(url: str, model: str, body: dict) -> list[dict]:
    with requests.post(f"http://{url}/v2/models/{model}/generate_stream", json={**body, "stream": True},
                       stream=True, timeout=30) as answer:  # fmt: skip
        assert answer.status_code == 200, answer.text
        return [json.loads(line[5:]) for line in answer.iter_lines(decode_unicode=True) if line.startswith("data:")]


@pytest.mark.parametrize(
    ("model", "prompt"),
    [
        ("llm", "gantry serves every model"),
        ("sp", "gantry serves every model on triton"),
        ("bytes", "naïve café 日本語 héllo"),
    ],  # fmt: skip
)
def test_streamed_text_equals_the_whole_decode_for_every_kind_of_tokenizer(engine, model, prompt):
    url, _, tokenizers = engine
    tokenizer = AutoTokenizer.from_pretrained(tokenizers[model])
    ids = [i for i in tokenizer.encode(prompt) if i not in tokenizer.all_special_ids]
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    # Decoded one token at a time, as the ensemble's postprocessing did, the text is wrong.
    if model != "llm":
        assert "".join(tokenizer.decode([i]) for i in ids) != expected
    events = _stream(url, model, {"text_input": prompt, "max_tokens": 64})
    streamed = "".join(e["text_output"] for e in events)
    assert streamed == expected
    assert all("\ufffd" not in e["text_output"] for e in events)  # never half a character
    assert sum(e["num_output_tokens"] for e in events) == len(ids)
    assert {e["num_input_tokens"] for e in events} == {len(tokenizer.encode(prompt))}
    whole = requests.post(f"http://{url}/v2/models/{model}/generate",
                          json={"text_input": prompt, "max_tokens": 64}, timeout=30)  # fmt: skip
    assert whole.status_code == 200, whole.text
    assert (whole.json()["text_output"], whole.json()["num_output_tokens"]) == (expected, len(ids))


def test_sampling_fields_and_stop_words_reach_the_engine_and_a_stop_string_ends_the_text(engine):
    url, record, tokenizers = engine
    before = len(_records(record))
    body = {"text_input": "gantry serves every model on triton", "max_tokens": 16, "temperature": 0.5,
            "random_seed": 9, "repetition_penalty": 1.1, "top_k": 5, "top_p": 0.9, "stop_words": ["model"]}  # fmt: skip
    events = _stream(url, "sp", body)
    # The text ends before the stop string, whatever the engine does with its token ids.
    assert "".join(e["text_output"] for e in events) == "gantry serves every "
    # A record is written when the engine's request ends, so an earlier test's may land after `before`.
    seen = wait_for(lambda: _mine(record, before, lambda r: r["streaming"] and r["stop_words_list"]), 10, "the record")
    assert seen["temperature"] == [0.5] and seen["random_seed"] == [9] and seen["runtime_top_k"] == [5]
    assert seen["repetition_penalty"] == pytest.approx([1.1]) and seen["runtime_top_p"] == pytest.approx([0.9])
    # [ids of "model"..., then each stop string's end offset]: one stop string of n tokens.
    flat = seen["stop_words_list"]
    ids, ends = flat[: len(flat) // 2], flat[len(flat) // 2 :]
    stop_ids = AutoTokenizer.from_pretrained(tokenizers["sp"]).encode("model", add_special_tokens=False)
    assert ids[: len(stop_ids)] == stop_ids and ends[0] == len(stop_ids)


def _byte_level_prompt(tokenizers: dict) -> tuple:
    """The byte-level engine's tokenizer, a prompt with characters of several bytes, and
    the token ids the stand-in echoes of it (the special ones dropped)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizers["bytes"])
    prompt = "naïve café on triton"
    return tokenizer, prompt, [i for i in tokenizer.encode(prompt) if i not in tokenizer.all_special_ids]


def test_penalties_the_logit_bias_and_log_probabilities_reach_the_engine_as_its_own_inputs(engine):
    url, record, tokenizers = engine
    tokenizer, prompt, ids = _byte_level_prompt(tokenizers)
    before = len(_records(record))
    body = {"text_input": prompt, "max_tokens": 32, "presence_penalty": 0.5, "frequency_penalty": 0.25,
            "logit_bias_ids": [7, 11], "logit_bias_values": [-100.0, 2.5], "return_log_probs": True}  # fmt: skip
    events = _stream(url, "bytes", body)
    seen = wait_for(lambda: _mine(record, before, lambda r: "embedding_bias" in r), 10, "the record")
    assert seen["presence_penalty"] == [0.5] and seen["frequency_penalty"] == [0.25]
    assert seen["return_log_probs"] == [True]
    # One value per token of the engine's vocabulary (its config.json's, padded past the tokenizer's).
    assert seen["embedding_bias"] == {"size": len(tokenizer) + 3, "set": {"7": -100.0, "11": 2.5}}
    # Each token once, in order, with the engine's log-probability and its own text and bytes,
    # in the response that carries it (a character's bytes may arrive before its text).
    entries = [entry for event in events for entry in json.loads(event["log_probs"])]
    assert [e["logprob"] for e in entries] == pytest.approx([-0.25 * (k + 1) for k in range(len(ids))])
    assert [e["token"] for e in entries] == [tokenizer.decode([i]) for i in ids]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8") == tokenizer.decode(ids)
    assert all(e["top_logprobs"] == [] for e in entries)
    whole = requests.post(f"http://{url}/v2/models/bytes/generate", json=body, timeout=30).json()
    assert json.loads(whole["log_probs"]) == entries

    # What the engine cannot do is refused by the input's name, and nothing reaches it.
    for refused, rule in (
        ({"return_log_probs": True, "top_log_probs": 2}, "top_log_probs"),
        ({"logit_bias_ids": [len(tokenizer) + 3], "logit_bias_values": [1.0]}, "token ids below"),
        ({"logit_bias_ids": [1, 2], "logit_bias_values": [1.0]}, "as long as each other"),
    ):
        answer = requests.post(f"http://{url}/v2/models/bytes/generate",
                               json={"text_input": prompt, "max_tokens": 4, **refused}, timeout=30)  # fmt: skip
        assert answer.status_code == 400 and rule in answer.json()["error"], (refused, answer.text)


def test_several_sequences_of_one_prompt_come_from_one_engine_request_each_with_its_index(engine):
    url, record, tokenizers = engine
    tokenizer, prompt, ids = _byte_level_prompt(tokenizers)
    before = len(_records(record))
    body = {"text_input": prompt, "max_tokens": 32, "num_return_sequences": 3, "return_log_probs": True}
    events = _stream(url, "bytes", body)
    seen = wait_for(lambda: _mine(record, before, lambda r: r["num_return_sequences"] == 3), 10, "the record")
    assert seen["streaming"] is True  # one engine request for the three
    # Sequence k is the stand-in's echo from the prompt's k-th token: each text whole, by its index.
    for k in range(3):
        mine = [e for e in events if e["sequence_index"] == k]
        assert "".join(e["text_output"] for e in mine) == tokenizer.decode(ids[k:] + ids[:k])
        assert sum(e["num_output_tokens"] for e in mine) == len(ids)
        assert len([entry for e in mine for entry in json.loads(e["log_probs"])]) == len(ids)
    whole = requests.post(f"http://{url}/v2/models/bytes/generate", json=body, timeout=30)
    assert whole.status_code == 200, whole.text  # Triton's generate answers the last response only
    # An engine model without num_return_sequences (0.12's) refuses it by name.
    asked = {"text_input": "gantry", "max_tokens": 4, "num_return_sequences": 2}
    answer = requests.post(f"http://{url}/v2/models/sp/generate", json=asked, timeout=30)
    assert answer.status_code == 400 and "num_return_sequences" in answer.json()["error"], answer.text


def test_a_client_that_goes_away_cancels_the_engine_request(engine):
    url, record, _ = engine
    before = len(_records(record))
    long_prompt = " ".join(["gantry serves every model"] * 20)
    with requests.post(f"http://{url}/v2/models/llm/generate_stream",
                       json={"text_input": long_prompt, "max_tokens": 80, "stream": True},
                       stream=True, timeout=30) as answer:  # fmt: skip
        lines = answer.iter_lines()
        for _ in range(3):
            next(lines)
    started = time.monotonic()
    seen = wait_for(lambda: _mine(record, before, lambda r: r["request_output_len"] == 80), 15, "the engine's record")
    # 80 tokens at 0.05 s would take 4 s: the engine stopped well before.
    assert seen["cancelled"] is True and seen["sent"] < 60, seen
    assert time.monotonic() - started < 4


def test_gantrys_generate_interface_reads_prompt_tokens_from_the_engine_path(engine):
    url, _, tokenizers = engine
    tokenizer = AutoTokenizer.from_pretrained(tokenizers["llm"])

    async def run() -> tuple[list[dict], list[dict]]:
        body = {"text_input": "one two three", "max_tokens": 8}
        streamed = [e async for e in generate_stream(url, "llm", {**body, "stream": True})]
        whole = [e async for e in generate_stream(url, "llm", body)]
        return streamed, whole

    streamed, whole = asyncio.run(run())
    assert "".join(e["text_output"] for e in streamed) == "one two three"
    assert [e["text_output"] for e in whole] == ["one two three"]
    assert sum(e["num_output_tokens"] for e in streamed) == 3 and whole[0]["num_output_tokens"] == 3
    assert whole[0]["num_input_tokens"] == len(tokenizer.encode("one two three"))


@pytest.mark.django_db(transaction=True)
def test_the_openai_client_chats_through_the_engine_path_via_the_gateway(engine, stack):  # noqa: ANN001
    """The gateway's chat on the engine route: the rows say a deployment serves the
    engine placement above (what a worker records after launching it); the web
    process, the generate model and the stand-in engine are real."""
    import openai

    from deployments.models import (
        Backend,
        BuildStatus,
        Deployment,
        DeploymentModel,
        DeploymentStatus,
        EngineBuild,
        Replica,
    )
    from gateway import services as gateway
    from upstream import chat_template

    url, _, tokenizers = engine
    host = factories.cpu_host("engine-host")
    checkpoint = factories.registered_model(name="engine-llm", kind="llm", path=tokenizers["llm"], host=host)
    deployment = Deployment.objects.create(name="engine", status=DeploymentStatus.READY, desired_state="running")
    Replica.objects.create(
        deployment=deployment, serial=1, host=host, http_port=int(url.rsplit(":", 1)[1]), grpc_port=1, metrics_port=2,
        generation=1, status=DeploymentStatus.READY,
    )  # fmt: skip
    # Built with TensorRT-LLM 0.16, whose engine model takes num_return_sequences.
    build = EngineBuild.objects.create(model=checkpoint, host=host, trtllm_version="0.16.0", cache_key="engine-llm",
                                       status=BuildStatus.SUCCEEDED, output_dir=str(tokenizers["llm"]))  # fmt: skip
    DeploymentModel.objects.create(
        deployment=deployment, triton_name="llm", registered_model=checkpoint, backend=Backend.TENSORRTLLM,
        engine_build=build,
    )  # fmt: skip
    gateway.alias_create(name="engine-chat", deployment_id=deployment.pk, triton_name="llm", user=stack.user)
    secret = gateway.key_create(name="t", user=stack.user, all_aliases=True).secret
    client = openai.OpenAI(base_url=f"{stack.web_url}/v1", api_key=secret, max_retries=0)

    # The stand-in engine echoes the prompt's tokens: the answer is the rendered chat prompt's start.
    messages = [{"role": "user", "content": "one two three"}]
    whole = client.chat.completions.create(model="engine-chat", messages=messages, max_tokens=8)
    rendered = whole.choices[0].message.content
    assert "one" in rendered or "user" in rendered.lower(), rendered
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
    # The prompt as Gantry renders it, counted by the generate model with the checkpoint's tokenizer.
    prompt = chat_template.render(checkpoint.chat_template, messages, special_tokens=checkpoint.special_tokens,
                                  model_name=checkpoint.name)  # fmt: skip
    assert whole.usage.prompt_tokens == len(AutoTokenizer.from_pretrained(tokenizers["llm"]).encode(prompt))

    stream = client.chat.completions.create(
        model="engine-chat", messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == rendered
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens and chunks[-1].usage.completion_tokens == 8

    # The chosen tokens' log-probabilities, whole and streamed, with penalties and a bias on the way.
    asked = {"model": "engine-chat", "messages": messages, "max_tokens": 8, "logprobs": True,
             "presence_penalty": 0.5, "logit_bias": {"5": -100}}  # fmt: skip
    content = client.chat.completions.create(**asked).choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx([-0.25 * (k + 1) for k in range(8)])
    tokenizer = AutoTokenizer.from_pretrained(tokenizers["llm"])
    echoed = [i for i in tokenizer.encode(prompt) if i not in tokenizer.all_special_ids][:8]
    assert [e.token for e in content] == [tokenizer.decode([i]) for i in echoed]
    assert all(e.top_logprobs == [] for e in content)
    streamed = [e for c in client.chat.completions.create(**asked, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # n choices from one engine request (num_return_sequences), whole and streamed.
    choices = client.chat.completions.create(model="engine-chat", messages=messages, max_tokens=8, n=3).choices
    assert [c.index for c in choices] == [0, 1, 2] and len({c.message.content for c in choices}) == 3
    assert choices[0].message.content == rendered
    pieces: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="engine-chat", messages=messages, max_tokens=8, n=3, stream=True):
        for choice in chunk.choices:
            pieces[choice.index] = pieces.get(choice.index, "") + (choice.delta.content or "")
    assert pieces == {c.index: c.message.content for c in choices}
    # What TensorRT-LLM 0.16 cannot do is refused by the field's name, with why.
    for field, extra in (("top_logprobs", {"logprobs": True, "top_logprobs": 2}),
                         ("response_format", {"response_format": {"type": "json_object"}})):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="engine-chat", messages=messages, max_tokens=8, **extra)
        assert refused.value.body["param"] == field and "TensorRT-LLM 0.16" in refused.value.body["message"]
