"""The playground service: refuses deployments that are not ready and models
they do not serve, and turns Triton's answers (the Triton client seam) into
similarities and a best-first order."""

from __future__ import annotations

import numpy as np
import pytest

from common.errors import InvalidTransition, ValidationFailed
from inference.embeddings import embed_texts, rerank_passages
from tests import factories
from triton_server.client import TritonClient


@pytest.fixture
def ready(minilm, operator):  # noqa: ANN001, ANN201
    deployment = factories.deployment(host=minilm.host, user=operator)
    return factories.deployment_in(deployment, "launching", "loading", "ready")


def test_embeddings_come_with_cosine_similarities(ready, monkeypatch):
    vectors = np.array([[3.0, 4.0], [6.0, 8.0], [4.0, -3.0]], dtype=np.float32)
    asked = []
    monkeypatch.setattr(TritonClient, "embed", lambda self, model, texts: asked.append((model, texts)) or vectors)
    result = embed_texts(deployment_id=ready.pk, texts=["a", "b", "c"])
    assert asked == [("minilm", ["a", "b", "c"])]
    assert result.model == "minilm"
    assert result.embeddings[0] == [3.0, 4.0]
    assert result.similarity[0] == pytest.approx([1.0, 1.0, 0.0])
    assert result.similarity[2][2] == pytest.approx(1.0)


def test_rerank_orders_passages_best_first_and_keeps_ties_stable(ready, monkeypatch, minilm_path):
    host = factories.replica_of(ready).host
    factories.registered_model(name="ranker", kind="reranker", path=minilm_path, host=host)
    with_ranker = factories.deployment(host=host, models=["ranker"], name="r")
    factories.deployment_in(with_ranker, "launching", "loading", "ready")
    monkeypatch.setattr(TritonClient, "rerank", lambda self, model, query, passages: np.array([0.1, 0.9, 0.1, 0.5]))
    result = rerank_passages(deployment_id=with_ranker.pk, query="q", passages=["w", "x", "y", "z"])
    assert result.order == [1, 3, 0, 2]
    assert result.scores == [0.1, 0.9, 0.1, 0.5]


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
    sizes = []

    def embed(self, model, texts):  # noqa: ANN001, ANN202
        sizes.append(len(texts))
        return np.array([[float(len(t)), 1.0] for t in texts], dtype=np.float32)

    monkeypatch.setattr(TritonClient, "embed", embed)
    texts = [f"text {'x' * i}" for i in range(10)]
    result = embed_texts(deployment_id=deployment.pk, texts=texts)
    assert sizes == [4, 4, 2]
    assert [row[0] for row in result.embeddings] == [float(len(t)) for t in texts]
