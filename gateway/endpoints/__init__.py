"""The gateway's endpoints, one module each, and the table of POST paths
gateway.app dispatches on."""

from __future__ import annotations

from gateway.endpoints import completions, embeddings, rerank, responses

POST = {
    "/v1/chat/completions": completions.chat,
    "/v1/completions": completions.completions,
    "/v1/embeddings": embeddings.embeddings,
    "/v1/rerank": rerank.rerank,
    "/v1/responses": responses.responses,
}
