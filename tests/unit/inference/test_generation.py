"""Generation requests are checked against the deployment and the checkpoint
before anything reaches Triton; chat messages become a prompt through the
checkpoint's own template."""

from __future__ import annotations

import pytest

from common.errors import InvalidTransition, ValidationFailed
from deployments.models import RegisteredModel
from inference.generation import Outcome, Sampling, prepare_generation
from tests import factories

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}{{ '<|assistant|>' }}"


@pytest.fixture
def llm_ready(host, operator, tmp_path):  # noqa: ANN001, ANN201
    config = {**factories.LLAMA, "max_position_embeddings": 512}
    checkpoint = factories.write_checkpoint(tmp_path / "tiny", config)
    model = factories.registered_model(name="tiny", kind="llm", path=checkpoint, host=host)
    RegisteredModel.objects.filter(pk=model.pk).update(chat_template=TEMPLATE, notice="untrained")
    deployment = factories.deployment(host=host, models=["tiny"], user=operator)
    return factories.deployment_in(deployment, "launching", "loading", "ready")


def test_a_prompt_and_its_sampling_fields_become_the_generate_interface(llm_ready):
    prepared = prepare_generation(
        deployment_id=llm_ready.pk,
        prompt="Once",
        sampling=Sampling(max_tokens=16, temperature=0.0, top_k=5, seed=7, stop=("\n",)),
    )
    assert prepared.model == "tiny" and prepared.notice == "untrained"
    [endpoint] = prepared.endpoints
    replica = factories.replica_of(llm_ready)
    assert (endpoint.url, endpoint.replica_id) == (f"127.0.0.1:{replica.http_port}", replica.pk)
    assert prepared.inputs == {
        "text_input": "Once",
        "max_tokens": 16,
        "temperature": 0.0,
        "top_k": 5,
        "random_seed": 7,
        "stop_words": ["\n"],
    }


def test_messages_are_rendered_with_the_checkpoints_template(llm_ready):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prepared = prepare_generation(deployment_id=llm_ready.pk, messages=messages, sampling=Sampling())
    assert prepared.inputs["text_input"] == "<|system|>Be brief.<|user|>Hi<|assistant|>"


@pytest.mark.parametrize(
    ("request_fields", "field", "rule"),
    [
        ({"prompt": "   "}, "prompt", "must not be empty"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt", "either prompt or messages"),
        ({"messages": []}, "messages", "at least one message"),
        # A chat too long is its messages' fault, named so (not "prompt", which it did not send).
        ({"messages": [{"role": "user", "content": "x" * 200_000}]}, "messages", "must be at most"),
        ({"prompt": "a", "sampling": Sampling(max_tokens=512)}, "max_tokens", "must be below 512, tiny's context"),
        ({"prompt": "a", "model": "nope"}, "model", "serves no llm named 'nope'"),
    ],
)
def test_bad_requests_name_the_field_and_the_rule(llm_ready, request_fields, field, rule):
    fields = {"sampling": Sampling(), **request_fields}
    with pytest.raises(ValidationFailed) as refused:
        prepare_generation(deployment_id=llm_ready.pk, **fields)
    assert rule in " ".join(refused.value.errors[field])


def test_chat_with_a_checkpoint_without_a_template_is_refused(llm_ready):
    RegisteredModel.objects.filter(name="tiny").update(chat_template="")
    with pytest.raises(ValidationFailed) as refused:
        prepare_generation(
            deployment_id=llm_ready.pk, messages=[{"role": "user", "content": "Hi"}], sampling=Sampling()
        )
    assert refused.value.errors == {
        "messages": ["tiny has no chat template in its tokenizer files: send a plain prompt instead"]
    }


def test_a_template_that_raises_names_its_reason(llm_ready):
    RegisteredModel.objects.filter(name="tiny").update(chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValidationFailed, match="roles must alternate"):
        prepare_generation(
            deployment_id=llm_ready.pk, messages=[{"role": "user", "content": "Hi"}], sampling=Sampling()
        )


def test_a_deployment_that_is_not_ready_is_refused(host, operator, tmp_path):
    checkpoint = factories.write_checkpoint(tmp_path / "tiny", factories.LLAMA)
    factories.registered_model(name="tiny", kind="llm", path=checkpoint, host=host)
    stopped = factories.deployment(host=host, models=["tiny"], user=operator)
    with pytest.raises(InvalidTransition, match="wait until it is ready"):
        prepare_generation(deployment_id=stopped.pk, prompt="a", sampling=Sampling())


def test_outcome_reports_time_to_first_token_and_the_decode_rate():
    outcome = Outcome(prompt_tokens=3, completion_tokens=11, started=10.0, first_token_at=10.05, ended=11.05)
    summary = outcome.summary()
    assert summary["usage"] == {"prompt_tokens": 3, "completion_tokens": 11, "total_tokens": 14}
    assert summary["time_to_first_token_ms"] == 50.0 and summary["tokens_per_s"] == 10.0
