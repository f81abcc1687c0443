"""/api/models/: register a checkpoint on a host (a folder, or a hub repository
the host downloads), read what its inspection found, and download it to more hosts."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.generics import get_object_or_404
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from access.idempotency import idempotent
from core.api.base import StrictSerializer, require_empty_body, validated
from core.api.lists import ListEndpoint
from core.permissions import ReadOrOperate
from core.validation import slug_validator
from deployments import selectors
from deployments.models import Inspection, ModelDownload, ModelKind, RegisteredModel
from deployments.services import downloads, registered_models


class CopyOut(serializers.Serializer):
    host = serializers.CharField(source="host.name")
    matches = serializers.BooleanField(help_text="its files match the registered fingerprint: replicas may go there")
    checked_at = serializers.DateTimeField(help_text="since when the host has held them as they are")
    used_at = serializers.DateTimeField(allow_null=True, help_text="when a replica last launched with it there")
    pinned = serializers.BooleanField(help_text="never evicted from that host's hub cache")


class DownloadOut(serializers.ModelSerializer):
    host = serializers.CharField(source="host.name")
    eta_s = serializers.IntegerField(
        allow_null=True, help_text="seconds left at the current rate (null when nothing is moving)"
    )

    class Meta:
        model = ModelDownload
        fields = ["id", "host", "status", "status_message", "commit", "files_done", "files_total", "bytes_done",
                  "bytes_total", "rate_bps", "eta_s", "created_at", "started_at", "finished_at"]  # fmt: skip


class ModelOut(serializers.ModelSerializer):
    host = serializers.CharField(source="host.name", default=None)
    downloads = DownloadOut(
        many=True, read_only=True, help_text="its hub downloads, newest first: live progress while they run"
    )
    copies = CopyOut(
        many=True, read_only=True,
        help_text="the hosts whose disk holds the checkpoint at its path, as their agents found it; a replica "
        "is placed only on a host whose copy matches",
    )  # fmt: skip
    has_chat_template = serializers.SerializerMethodField(help_text="whether chat messages can be sent to it")

    def get_has_chat_template(self, model: RegisteredModel) -> bool:
        return bool(model.chat_template)

    class Meta:
        model = RegisteredModel
        fields = [
            "id",
            "name",
            "kind",
            "path",
            "hub_id",
            "revision",
            "commit",
            "allow_patterns",
            "ignore_patterns",
            "downloads",
            "architecture",
            "host",
            "copies",
            "inspection",
            "inspection_message",
            "model_type",
            "parameter_count",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
            "torch_dtype",
            "size_bytes",
            "tokenizer_files",
            "fingerprint",
            "trust_remote_code",
            "has_chat_template",
            "special_tokens",
            "notice",
            "created_at",
        ]


class ModelIn(StrictSerializer):
    name = serializers.CharField(max_length=63, validators=[slug_validator])
    kind = serializers.ChoiceField(choices=ModelKind.choices)
    host = serializers.CharField(
        max_length=63, help_text="the GPU host that holds the checkpoint folder, or downloads it from the hub first"
    )
    path = serializers.CharField(
        max_length=1024, required=False, default="", allow_blank=True,
        help_text="the checkpoint folder on that host; leave it out to download hub_id from the hub",
    )  # fmt: skip
    hub_id = serializers.CharField(
        max_length=255, required=False, default="", allow_blank=True, help_text="the hub repository, owner/name"
    )
    revision = serializers.CharField(
        max_length=255, required=False, default="", allow_blank=True,
        help_text="a branch, tag or commit (default main); pinned to its commit at the first download",
    )  # fmt: skip
    allow_patterns = serializers.ListField(
        child=serializers.CharField(max_length=200), required=False, default=list,
        help_text="download only files matching one of these globs",
    )  # fmt: skip
    ignore_patterns = serializers.ListField(
        child=serializers.CharField(max_length=200), required=False, default=list,
        help_text="do not download files matching one of these globs",
    )  # fmt: skip
    trust_remote_code = serializers.BooleanField(
        default=False, help_text="let the checkpoint's own Python code (auto_map) run on the host"
    )


class ModelQuery(StrictSerializer):
    kind = serializers.ChoiceField(choices=ModelKind.choices, required=False)
    host = serializers.CharField(max_length=63, required=False)
    inspection = serializers.ChoiceField(choices=Inspection.choices, required=False)
    name = serializers.CharField(max_length=63, required=False, help_text="names containing this")


class ModelList(ListEndpoint):
    """GET /api/models/ (by name); POST registers a checkpoint and queues its inspection."""

    permission_classes = [ReadOrOperate]
    serializer_class = ModelOut
    query_class = ModelQuery
    ordering_fields = ("name", "created_at", "id")
    ordering = "name"

    def get_queryset(self) -> QuerySet[RegisteredModel]:
        return selectors.model_list()

    def filter_rows(self, rows: QuerySet[RegisteredModel], query: dict[str, Any]) -> QuerySet[RegisteredModel]:
        lookups = {"kind": "kind", "host": "host__name", "inspection": "inspection"}
        rows = rows.filter(**{lookups[k]: v for k, v in query.items() if k in lookups})
        return rows.filter(name__contains=query["name"]) if "name" in query else rows

    @idempotent()
    @extend_schema(request=ModelIn, responses={201: ModelOut})
    def post(self, request: Request) -> Response:
        data = validated(ModelIn, request)
        model = registered_models.model_register(user=request.user, **data)
        return Response(ModelOut(model).data, status=status.HTTP_201_CREATED)


class ModelDetail(APIView):
    """GET one model; DELETE unregisters it (refused while builds or deployments use it)."""

    permission_classes = [ReadOrOperate]

    @extend_schema(responses={204: None})
    def delete(self, request: Request, pk: int) -> Response:
        registered_models.model_delete(model_id=pk, user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(responses=ModelOut)
    def get(self, request: Request, pk: int) -> Response:
        return Response(ModelOut(get_object_or_404(selectors.model_list(), pk=pk)).data)


class DownloadIn(StrictSerializer):
    host = serializers.CharField(max_length=63, help_text="the GPU host that downloads the model into its cache")


class ModelDownloads(APIView):
    """POST /api/models/<id>/downloads/: a host downloads the hub model (at the
    commit its first download pinned) into its own cache."""

    permission_classes = [ReadOrOperate]

    @idempotent()
    @extend_schema(request=DownloadIn, responses={202: DownloadOut})
    def post(self, request: Request, pk: int) -> Response:
        data = validated(DownloadIn, request)
        download = downloads.download_request(model_id=pk, host=data["host"], user=request.user)
        return Response(DownloadOut(download).data, status=status.HTTP_202_ACCEPTED)


class DownloadCancel(APIView):
    """POST /api/downloads/<id>/cancel/: stop a download (the files fetched stay; a new one resumes)."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=None, responses={202: DownloadOut})
    def post(self, request: Request, pk: int) -> Response:
        require_empty_body(request)
        get_object_or_404(ModelDownload, pk=pk)
        return Response(
            DownloadOut(downloads.download_cancel(download_id=pk, user=request.user)).data,
            status=status.HTTP_202_ACCEPTED,
        )


class CopyIn(StrictSerializer):
    pinned = serializers.BooleanField(help_text="never evict it from this host's hub cache")


class ModelCopy(APIView):
    """PATCH /api/models/<id>/copies/<host name>/ pins a hub model in that host's
    cache (or unpins it); DELETE removes it from that host (refused while a
    replica there uses it)."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=CopyIn, responses={200: CopyOut})
    def patch(self, request: Request, pk: int, name: str) -> Response:
        data = validated(CopyIn, request)
        return Response(CopyOut(downloads.copy_pin(model_id=pk, host=name, user=request.user, **data)).data)

    @extend_schema(request=None, responses={202: None})
    def delete(self, request: Request, pk: int, name: str) -> Response:
        downloads.copy_remove(model_id=pk, host=name, user=request.user)
        return Response(status=status.HTTP_202_ACCEPTED)
