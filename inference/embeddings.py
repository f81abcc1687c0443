"""Embeddings and rerank scores from deployed models (Triton has no user auth
of its own, so users reach models through Gantry): by deployment for the
playground's API, by route for the gateway."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
from asgiref.sync import async_to_sync

from common.errors import InvalidTransition, NotFound, TransientError, ValidationFailed
from deployments.models import Deployment, DeploymentModel, ModelKind
from deployments.states import ANSWERING
from inference.balancing import Endpoint, answering, call
from triton_server.client import infer_async

MAX_TEXTS = 64
MAX_TEXT_CHARS = 4000


@dataclass(frozen=True)
class EmbeddingResult:
    model: str
    embeddings: list[list[float]]
    similarity: list[list[float]]


def _ready_placement(deployment_id: int, kind: str, model: str) -> tuple[list[Endpoint], DeploymentModel]:
    """The deployment's answering replicas and its ``kind`` placement (named, or its first)."""
    deployment = Deployment.objects.filter(pk=deployment_id).first()
    if deployment is None:
        raise NotFound(f"deployment {deployment_id} does not exist")
    endpoints = answering(deployment_id)
    if not endpoints and deployment.status in ANSWERING:
        raise TransientError(f"{deployment.name}: none of its replicas can be reached now (host offline or revoked)")
    if not endpoints:
        raise InvalidTransition(f"{deployment.name} is {deployment.status}; start it and wait until it is ready")
    candidates = deployment.placements.filter(registered_model__kind=kind)
    placement = candidates.filter(triton_name=model).first() if model else candidates.first()
    if placement is None:
        raise ValidationFailed(
            {"model": f"{deployment.name} serves no {kind} model" + (f" named {model!r}" if model else "")}
        )
    return endpoints, placement


def embed_texts(*, deployment_id: int, texts: list[str], model: str = "") -> EmbeddingResult:
    """Embeddings of ``texts`` from an embedding model of a ready deployment, and their cosine similarities."""
    endpoints, placement = _ready_placement(deployment_id, ModelKind.EMBEDDING, model)
    name = placement.triton_name
    vectors, _ = async_to_sync(embed_async)(
        endpoints=endpoints, model=name, texts=texts, max_batch_size=placement.max_batch_size
    )
    # Rows are L2-normalized by the model; normalize again so any embedder's output compares fairly.
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    unit = vectors / np.clip(norms, 1e-12, None)
    return EmbeddingResult(
        model=name,
        embeddings=vectors.astype(float).tolist(),
        similarity=np.round(unit @ unit.T, 6).astype(float).tolist(),
    )


@dataclass(frozen=True)
class RerankResult:
    model: str
    scores: list[float]
    order: list[int]


def rerank_passages(*, deployment_id: int, query: str, passages: list[str], model: str = "") -> RerankResult:
    """Scores of ``passages`` for ``query`` from a reranker of a ready deployment, best first in ``order``."""
    endpoints, placement = _ready_placement(deployment_id, ModelKind.RERANKER, model)
    name = placement.triton_name
    scores, _ = async_to_sync(rerank_async)(endpoints=endpoints, model=name, query=query, documents=passages)
    return RerankResult(
        model=name,
        scores=[round(float(score), 6) for score in scores],
        order=[int(i) for i in np.argsort(-scores, kind="stable")],
    )


async def embed_async(
    *, endpoints: list[Endpoint], model: str, texts: list[str], max_batch_size: int
) -> tuple[np.ndarray, int]:
    """Embeddings (float32 rows) of ``texts`` from the embedding model ``model``
    on the best of ``endpoints``, and the tokens they took. Triton refuses a
    batch above the model's max_batch_size: the texts go in batches that fit,
    all at once."""
    step = max_batch_size
    batches = [np.array([[t] for t in texts[i : i + step]], dtype=object) for i in range(0, len(texts), step)]

    async def request(endpoint: Endpoint) -> list[dict[str, np.ndarray]]:
        return await asyncio.gather(
            *(infer_async(endpoint.url, model, {"TEXT": batch}, endpoint.channel) for batch in batches)
        )

    outputs = await call(endpoints, request)
    vectors = np.concatenate([o["EMBEDDING"] for o in outputs]).astype("<f4", copy=False)
    return vectors, sum(int(o["NUM_TOKENS"].sum()) for o in outputs if "NUM_TOKENS" in o)


async def rerank_async(
    *, endpoints: list[Endpoint], model: str, query: str, documents: list[str]
) -> tuple[np.ndarray, int]:
    """The reranker's score of each of ``documents`` for ``query`` (on the best of
    ``endpoints``), and the tokens they took."""
    inputs = {"QUERY": np.array([[query]], dtype=object), "PASSAGES": np.array([documents], dtype=object)}
    output = await call(endpoints, lambda endpoint: infer_async(endpoint.url, model, inputs, endpoint.channel))
    tokens = int(output["NUM_TOKENS"].sum()) if "NUM_TOKENS" in output else 0
    return output["SCORES"].reshape(-1), tokens
