"""POST /v1/embeddings: an embedding alias's vectors, as floats or base64."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from common.asgi_io import send_json
from deployments.models import ModelKind
from gateway import requests
from gateway.access import Caller, Target
from gateway.endpoints.shared import count, failures_counted, resolve
from gateway.errors import bad_request
from gateway.metering import admit, prompt_bound
from gateway.requests import EmbeddingRequest
from inference.embeddings import embed_async


async def embeddings(caller: Caller, body: Any, receive: Any, send: Any) -> None:
    data = requests.parse(EmbeddingRequest, body)
    target = await resolve(caller, data.model, ModelKind.EMBEDDING, "/v1/embeddings")
    if data.dimensions is not None:
        _check_dimensions(target, data.dimensions)
    inputs = data.input
    # One request per input; each may take its bytes and the two tokens around it.
    admission = await admit(caller, target.alias, requests=len(inputs), reserve=prompt_bound(*inputs) + 2 * len(inputs))
    with failures_counted(caller, target, admission, requests=len(inputs)):
        vectors, tokens = await embed_async(
            endpoints=target.endpoints,
            model=target.triton_name,
            texts=inputs,
            max_batch_size=target.max_batch_size,
        )
    count(caller, target.alias, admission, requests=len(inputs), prompt=tokens)
    if data.dimensions is not None:
        vectors = shortened(vectors, data.dimensions)
    if data.encoding_format == "base64":
        encoded = [base64.b64encode(row.tobytes()).decode("ascii") for row in vectors]
    else:
        encoded = vectors.tolist()
    await send_json(
        send,
        200,
        {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)],
            "model": target.alias,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        },
    )


def _check_dimensions(target: Target, dimensions: int) -> None:
    if not target.matryoshka:
        raise bad_request(
            "dimensions",
            f"{target.alias}'s checkpoint was not trained for shortened embeddings (its model card names no "
            "Matryoshka training): its vectors keep their width",
        )
    if target.dimension and dimensions > target.dimension:
        raise bad_request("dimensions", f"must be at most {target.dimension}, {target.alias}'s width")


def shortened(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """Matryoshka embeddings cut to their first ``dimensions``, made unit length again
    (as sentence-transformers' truncate_dim and OpenAI's dimensions do)."""
    cut = vectors[:, :dimensions]
    return (cut / np.clip(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12, None)).astype(np.float32)
