from __future__ import annotations

from dataclasses import asdict

from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from deployments.api.base import StrictSerializer, validated
from deployments.errors import TransientError
from deployments.permissions import CanView
from playground.services import MAX_TEXT_CHARS, MAX_TEXTS, embed_texts, rerank_passages


class EmbedIn(StrictSerializer):
    texts = serializers.ListField(
        child=serializers.CharField(max_length=MAX_TEXT_CHARS, trim_whitespace=True),
        min_length=1,
        max_length=MAX_TEXTS,
    )
    model = serializers.CharField(max_length=63, required=False, default="", allow_blank=True)


class DeploymentEmbed(APIView):
    """POST /api/deployments/<id>/embed/ {"texts": [...]} -> embeddings and cosine similarities."""

    # Querying a model only reads: viewers may use the playground too.
    permission_classes = [CanView]

    def post(self, request: Request, pk: int) -> Response:
        data = validated(EmbedIn, request)
        try:
            result = embed_texts(deployment_id=pk, texts=data["texts"], model=data["model"])
        except TransientError as exc:
            return Response({"detail": str(exc)}, status=503)
        return Response(asdict(result))


class RerankIn(StrictSerializer):
    query = serializers.CharField(max_length=MAX_TEXT_CHARS)
    passages = serializers.ListField(
        child=serializers.CharField(max_length=MAX_TEXT_CHARS), min_length=1, max_length=MAX_TEXTS
    )
    model = serializers.CharField(max_length=63, required=False, default="", allow_blank=True)


class DeploymentRerank(APIView):
    """POST /api/deployments/<id>/rerank/ {"query": ..., "passages": [...]} -> one score per passage."""

    permission_classes = [CanView]

    def post(self, request: Request, pk: int) -> Response:
        data = validated(RerankIn, request)
        try:
            result = rerank_passages(
                deployment_id=pk, query=data["query"], passages=data["passages"], model=data["model"]
            )
        except TransientError as exc:
            return Response({"detail": str(exc)}, status=503)
        return Response(asdict(result))
