"""Querying a ready deployment's models through Gantry (Triton has no user
auth of its own, so signed-in users reach models here)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deployments.errors import InvalidTransition, NotFound, ValidationFailed
from deployments.models import Deployment, DeploymentModel, DeploymentStatus, ModelKind
from workers.triton.client import TritonClient

MAX_TEXTS = 64
MAX_TEXT_CHARS = 4000


@dataclass(frozen=True)
class EmbeddingResult:
    model: str
    embeddings: list[list[float]]
    similarity: list[list[float]]


def _ready_placement(deployment_id: int, kind: str, model: str) -> tuple[Deployment, DeploymentModel]:
    deployment = Deployment.objects.select_related("host").filter(pk=deployment_id).first()
    if deployment is None:
        raise NotFound(f"deployment {deployment_id} does not exist")
    if deployment.status not in {DeploymentStatus.READY, DeploymentStatus.DEGRADED}:
        raise InvalidTransition(f"{deployment.name} is {deployment.status}; start it and wait until it is ready")
    candidates = deployment.placements.filter(registered_model__kind=kind)
    placement = candidates.filter(triton_name=model).first() if model else candidates.first()
    if placement is None:
        raise ValidationFailed(
            {"model": f"{deployment.name} serves no {kind} model" + (f" named {model!r}" if model else "")}
        )
    return deployment, placement


def _client(deployment: Deployment) -> TritonClient:
    return TritonClient(f"{deployment.host.address}:{deployment.http_port}")


def embed_texts(*, deployment_id: int, texts: list[str], model: str = "") -> EmbeddingResult:
    """Embeddings of ``texts`` from an embedding model of a ready deployment, and their cosine similarities."""
    deployment, placement = _ready_placement(deployment_id, ModelKind.EMBEDDING, model)
    name = placement.triton_name
    client = _client(deployment)
    try:
        # Triton refuses a batch above the model's max_batch_size: send it in batches that fit.
        step = placement.max_batch_size
        vectors = np.concatenate([client.embed(name, texts[i : i + step]) for i in range(0, len(texts), step)])
    finally:
        client.close()
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
    deployment, placement = _ready_placement(deployment_id, ModelKind.RERANKER, model)
    name = placement.triton_name
    client = _client(deployment)
    try:
        scores = client.rerank(name, query, passages)
    finally:
        client.close()
    return RerankResult(
        model=name,
        scores=[round(float(score), 6) for score in scores],
        order=[int(i) for i in np.argsort(-scores, kind="stable")],
    )
