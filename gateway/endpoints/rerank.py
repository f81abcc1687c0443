"""POST /v1/rerank: a reranker alias's scores of documents against a query, best first."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

from common.asgi_io import send_json
from deployments.models import ModelKind
from gateway import requests
from gateway.access import Caller
from gateway.endpoints.shared import count, failures_counted, resolve
from gateway.metering import admit, prompt_bound
from gateway.requests import RerankRequest
from inference.embeddings import rerank_async


async def rerank(caller: Caller, body: Any, receive: Any, send: Any) -> None:
    data = requests.parse(RerankRequest, body)
    target = await resolve(caller, data.model, ModelKind.RERANKER, "/v1/rerank")
    documents = data.documents
    # Each document is scored beside the query: both, and three tokens around them.
    reserve = (prompt_bound(data.query) + 3) * len(documents) + prompt_bound(*documents)
    admission = await admit(caller, target.alias, reserve=reserve)
    with failures_counted(caller, target, admission):
        scores, tokens = await rerank_async(
            endpoints=target.endpoints, model=target.triton_name, query=data.query, documents=documents
        )
    count(caller, target.alias, admission, prompt=tokens)
    order = np.argsort(-scores, kind="stable")[: data.top_n or len(documents)]
    results = []
    for index in order:
        result: dict[str, Any] = {"index": int(index), "relevance_score": float(scores[index])}
        if data.return_documents:
            result["document"] = {"text": documents[index]}
        results.append(result)
    await send_json(
        send,
        200,
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "object": "list",
            "model": target.alias,
            "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        },
    )
