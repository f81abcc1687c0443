"""The playground service: refuses deployments that are not ready and models
they do not serve, and turns Triton's answers (the Triton client seam) into
similarities and a best-first order."""

from __future__ import annotations

import numpy as np
import pytest

from common.errors import InvalidTransition, ValidationFailed
from inference import embeddings
from inference.embeddings import embed_texts, rerank_passages
from tests import factories


def triton_answers(monkeypatch, answer) -> list:  # noqa: ANN001
    """Triton's answers at the client seam (inference.embeddings.infer_async): ``answer(model, inputs)``."""
    asked = []

    async def infer(url, model, inputs, channel=None):  # noqa: ANN001, ANN202
        asked.append((model, inputs))
        return answer(model, inputs)

    monkeypatch.setattr(embeddings, "infer_async", infer)
    return asked


@pytest.fixture
def ready(minilm, operator):  # noqa: ANN001, ANN201
    deployment = factories.deployment(host=minilm.host, user=operator)
    return factories.deployment_in(deployment, "launching", "loading", "ready")


def test_embeddings_come_with_cosine_similarities(ready, monkeypatch):
    vectors = np.array([[3.0, 4.0], [6.0, 8.0], [4.0, -3.0]], dtype=np.float32)
    asked = triton_answers(monkeypatch, lambda model, inputs: {"EMBEDDING": vectors})
    result = embed_texts(deployment_id=ready.pk, texts=["a", "b", "c"])
    assert [(model, inputs["TEXT"].reshape(-1).tolist()) for model, inputs in asked] == [("minilm", ["a", "b", "c"])]
    assert result.model == "minilm"
    assert result.embeddings[0] == [3.0, 4.0]
    assert result.similarity[0] == pytest.approx([1.0, 1.0, 0.0])
    assert result.similarity[2][2] == pytest.approx(1.0)


def test_rerank_orders_passages_best_first_and_keeps_ties_stable(ready, monkeypatch, minilm_path):
    host = factories.replica_of(ready).host
    factories.registered_model(name="ranker", kind="reranker", path=minilm_path, host=host)
    with_ranker = factories.deployment(host=host, models=["ranker"], name="r")
    factories.deployment_in(with_ranker, "launching", "loading", "ready")
    triton_answers(monkeypatch, lambda model, inputs: {"SCORES": np.array([[0.1, 0.9, 0.1, 0.5]], dtype=np.float32)})
    result = rerank_passages(deployment_id=with_ranker.pk, query="q", passages=["w", "x", "y", "z"])
    assert result.order == [1, 3, 0, 2]
    assert result.scores == pytest.approx([0.1, 0.9, 0.1, 0.5])


def test_a_deployment_that_is_not_ready_is_refused(minilm, operator):
    stopped = factories.deployment(host=minilm.host, user=operator)
    with pytest.raises(InvalidTransition, match="start it and wait until it is ready"):
        embed_texts(deployment_id=stopped.pk, texts=["a"])


def test_a_model_the_deployment_does_not_serve_is_named(ready):
    with pytest.raises(ValidationFailed) as refused:
        rerank_passages(deployment_id=ready.pk, query="q", passages=["p"])
    assert refused.value.errors == {"model": ["d serves no reranker model"]}
    with pytest.raises(ValidationFailed, match="named 'other'"):
        embed_texts(deployment_id=ready.pk, texts=["a"], model="other")


def test_more_texts_than_the_model_batches_go_to_triton_in_batches(minilm, operator, monkeypatch):
    deployment = factories.deployment(host=minilm.host, user=operator, max_batch_size=4)
    factories.deployment_in(deployment, "launching", "loading", "ready")

    def embed(model, inputs):  # noqa: ANN001, ANN202
        return {"EMBEDDING": np.array([[float(len(t)), 1.0] for t in inputs["TEXT"].reshape(-1)], dtype=np.float32)}

    asked = triton_answers(monkeypatch, embed)
    texts = [f"text {'x' * i}" for i in range(10)]
    result = embed_texts(deployment_id=deployment.pk, texts=texts)
    assert [len(inputs["TEXT"]) for _, inputs in asked] == [4, 4, 2]
    assert [row[0] for row in result.embeddings] == [float(len(t)) for t in texts]
