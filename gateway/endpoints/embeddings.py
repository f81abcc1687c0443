"""POST /v1/embeddings: an embedding alias's vectors, as floats or base64."""

from __future__ import annotations

import base64
from typing import Any

from common.asgi_io import send_json
from deployments.models import ModelKind
from gateway import requests
from gateway.access import Caller
from gateway.endpoints.shared import count, failures_counted, resolve
from gateway.metering import admit, prompt_bound
from gateway.requests import EmbeddingRequest
from inference.embeddings import embed_async


async def embeddings(caller: Caller, body: Any, receive: Any, send: Any) -> None:
    data = requests.parse(EmbeddingRequest, body)
    target = await resolve(caller, data.model, ModelKind.EMBEDDING, "/v1/embeddings")
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
