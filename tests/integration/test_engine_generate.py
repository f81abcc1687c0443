"""The engine path in a real tritonserver: Gantry's generated tensorrtllm
repository (preprocessing, engine, postprocessing, ensemble) loads with a
test-only python model standing in for the engine (same inputs and outputs,
decoupled: TensorRT-LLM cannot run here), and text goes through the ensemble
end to end with Triton's generate and generate_stream, and through Gantry's
own generate interface, exactly as it does for the transformers path."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest
import requests
from transformers import AutoTokenizer

from tests import factories
from tests.integration.conftest import ROOT, free_ports, wait_for
from workers.runtimes.process import ProcessRuntime
from workers.triton.client import TritonClient, generate_stream
from workers.triton.config import Batching, TrtllmSpec, parse_text, to_text
from workers.triton.repository import write_repository
from workers.untrained_llm import make_untrained_llm

pytestmark = pytest.mark.integration


def _stand_in_for_the_engine(repository: Path, spec: TrtllmSpec) -> None:
    """Same config as Gantry wrote for the engine model, but run by the python
    backend with the stand-in's code (the tensorrtllm backend's parameters dropped)."""
    folder = repository / spec.engine_model
    config = parse_text((folder / "config.pbtxt").read_text())
    config.backend = "python"
    config.ClearField("parameters")
    config.parameters["step_delay_s"].string_value = "0.05"
    (folder / "config.pbtxt").write_text(to_text(config))
    shutil.copyfile(ROOT / "tests/fixtures/engine_standin_model.py", folder / "1" / "model.py")


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    tmp_path = tmp_path_factory.mktemp("ensemble")
    tokenizer_dir = make_untrained_llm(tmp_path / "tiny-llama")
    spec = TrtllmSpec(
        name="llm",
        engine_dir="/nonexistent/engine",
        tokenizer_dir=str(tokenizer_dir),
        batching=Batching(max_batch_size=8),
        gpu_device_ids=(0,),
    )
    repository = tmp_path / "deployment" / "repository"
    write_repository(repository, [spec])
    _stand_in_for_the_engine(repository, spec)
    record = tmp_path / "engine-requests.jsonl"
    os.environ["GANTRY_STANDIN_RECORD"] = str(record)  # read by the stand-in inside the server
    port = free_ports(3)
    launch = factories.launch_spec(
        tmp_path / "deployment", models=spec.model_names, http_port=port, grpc_port=port + 1, metrics_port=port + 2
    )
    runtime = ProcessRuntime(tmp_path / "data")
    handle = runtime.start(launch)
    try:
        client = TritonClient(f"127.0.0.1:{port}")
        client.wait_until_ready(launch.models, timeout_s=120, keep_waiting=lambda: runtime.is_running(handle, launch))
        client.close()
        yield f"127.0.0.1:{port}", record, tokenizer_dir
    finally:
        runtime.stop(handle, launch)
        os.environ.pop("GANTRY_STANDIN_RECORD", None)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_text_goes_through_the_generated_ensemble_with_generate_and_generate_stream(ensemble):
    url, record, tokenizer_dir = ensemble
    prompt = "gantry serves every model"
    prompt_tokens = len(AutoTokenizer.from_pretrained(tokenizer_dir).encode(prompt, add_special_tokens=False))

    # generate: one answer, the echo engine's tokens decoded by postprocessing.
    whole = requests.post(
        f"http://{url}/v2/models/llm/generate", json={"text_input": prompt, "max_tokens": 16}, timeout=30
    )
    assert whole.status_code == 200, whole.text
    assert whole.json()["text_output"] == prompt
    assert whole.json()["num_output_tokens"] == prompt_tokens

    # generate_stream: one event per token, each with the tokens it adds.
    body = {"text_input": prompt, "max_tokens": 3, "stream": True, "temperature": 0.5, "random_seed": 9,
            "repetition_penalty": 1.1, "stop_words": ["models"]}  # fmt: skip
    before = len(_records(record))
    with requests.post(f"http://{url}/v2/models/llm/generate_stream", json=body, stream=True, timeout=30) as streamed:
        events = [json.loads(line[5:]) for line in streamed.iter_lines(decode_unicode=True) if line.startswith("data:")]
    texts = [e["text_output"] for e in events if e.get("text_output")]
    assert len(texts) == 3 and prompt.replace(" ", "").startswith("".join(texts).replace("##", ""))
    assert sum(e.get("num_output_tokens", 0) for e in events) == 3

    # The sampling fields and stop words reached the engine through the ensemble.
    # The stand-in writes its record after its final response: wait for this stream's.
    streamed_request = wait_for(
        lambda: next((r for r in _records(record)[before:] if r["streaming"]), None), 10, "the stream's record"
    )
    assert streamed_request["streaming"] is True
    assert streamed_request["temperature"] == [0.5] and streamed_request["random_seed"] == [9]
    assert streamed_request["repetition_penalty"] == pytest.approx([1.1])
    # [ids of "models"..., then each stop string's end offset]: one stop string of n tokens.
    flat = streamed_request["stop_words_list"]
    ids, ends = flat[: len(flat) // 2], flat[len(flat) // 2 :]
    assert ids[0] > 0 and ends[0] == len([i for i in ids if i > 0]) and ends[1:] == [-1] * (len(ends) - 1)


def test_gantrys_generate_interface_treats_the_ensemble_like_the_transformers_model(ensemble):
    url, _, _ = ensemble

    async def run() -> tuple[list[dict], list[dict]]:
        streamed = [
            e
            async for e in generate_stream(url, "llm", {"text_input": "one two three", "max_tokens": 8, "stream": True})
        ]
        whole = [e async for e in generate_stream(url, "llm", {"text_input": "one two three", "max_tokens": 8})]
        return streamed, whole

    streamed, whole = asyncio.run(run())
    assert " ".join(e["text_output"] for e in streamed if e["text_output"]) == "one two three"
    assert [e["text_output"] for e in whole] == ["one two three"]
    assert sum(e["num_output_tokens"] for e in streamed) == 3 and whole[0]["num_output_tokens"] == 3
    assert all("num_input_tokens" not in e for e in streamed + whole)  # see ensemble_config


@pytest.mark.django_db(transaction=True)
def test_the_openai_client_chats_through_the_ensemble_via_the_gateway(ensemble, stack):  # noqa: ANN001
    """The gateway's chat on the engine route: the rows say a deployment serves the
    ensemble above (what a worker records after launching it); the web process,
    the ensemble and the stand-in engine are real. Prompt tokens are counted by
    the ensemble's own preprocessing model."""
    import openai

    from deployments import chat_template
    from deployments.models import Backend, Deployment, DeploymentModel, DeploymentStatus
    from gateway import services as gateway

    url, _, tokenizer_dir = ensemble
    host = factories.cpu_host("engine-host")
    checkpoint = factories.registered_model(name="engine-llm", kind="llm", path=tokenizer_dir, host=host)
    deployment = Deployment.objects.create(
        name="engine", host=host, http_port=int(url.rsplit(":", 1)[1]), grpc_port=1, metrics_port=2,
        status=DeploymentStatus.READY, desired_state="running",
    )  # fmt: skip
    DeploymentModel.objects.create(
        deployment=deployment, triton_name="llm", registered_model=checkpoint, backend=Backend.TENSORRTLLM
    )
    gateway.alias_create(name="engine-chat", deployment_id=deployment.pk, triton_name="llm", user=stack.user)
    secret = gateway.key_create(name="t", user=stack.user, all_aliases=True).secret
    client = openai.OpenAI(base_url=f"{stack.web_url}/v1", api_key=secret, max_retries=0)

    # The stand-in engine echoes the prompt's tokens: the answer is the rendered chat prompt's start.
    messages = [{"role": "user", "content": "one two three"}]
    whole = client.chat.completions.create(model="engine-chat", messages=messages, max_tokens=8)
    rendered = whole.choices[0].message.content
    assert "one" in rendered or "user" in rendered.lower(), rendered
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
    # The prompt as Gantry renders it, tokenized as the preprocessing model does.
    prompt = chat_template.render(checkpoint.chat_template, messages, special_tokens=checkpoint.special_tokens,
                                  model_name=checkpoint.name)  # fmt: skip
    assert whole.usage.prompt_tokens == len(AutoTokenizer.from_pretrained(tokenizer_dir).encode(prompt))

    stream = client.chat.completions.create(
        model="engine-chat", messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).replace(" ", "") == rendered.replace(
        " ", ""
    )
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens and chunks[-1].usage.completion_tokens == 8
