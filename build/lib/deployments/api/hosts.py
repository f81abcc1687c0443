"""GET /api/hosts/ and /api/hosts/<name>/: GPU hosts and their GPUs."""

from __future__ import annotations

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.generics import get_object_or_404
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from deployments import selectors
from deployments.api.lists import ListEndpoint
from deployments.models import Gpu, GpuHost
from deployments.permissions import ReadOrOperate


class GpuOut(serializers.ModelSerializer):
    class Meta:
        model = Gpu
        fields = [
            "index",
            "uuid",
            "name",
            "compute_capability",
            "memory_total_bytes",
            "memory_used_bytes",
            "utilization_percent",
            "updated_at",
        ]


class HostOut(serializers.ModelSerializer):
    gpus = GpuOut(many=True, read_only=True)
    is_online = serializers.BooleanField(read_only=True)
    queue = serializers.CharField(read_only=True, help_text="The control queue: launch, stop, apply, inspect.")
    jobs_queue = serializers.CharField(read_only=True, help_text="The jobs queue: engine builds and load tests.")

    class Meta:
        model = GpuHost
        fields = [
            "name",
            "address",
            "is_online",
            "last_heartbeat",
            "driver_version",
            "cuda_version",
            "nvml_error",
            "agent_version",
            "queue",
            "jobs_queue",
            "gpus",
        ]


class HostList(ListEndpoint):
    """GET /api/hosts/: every GPU host that has announced itself, by name."""

    permission_classes = [ReadOrOperate]
    serializer_class = HostOut
    ordering_fields = ("name", "last_heartbeat")
    ordering = "name"

    def get_queryset(self) -> QuerySet[GpuHost]:
        return selectors.host_list()


class HostDetail(APIView):
    permission_classes = [ReadOrOperate]

    @extend_schema(responses=HostOut)
    def get(self, request: Request, name: str) -> Response:
        return Response(HostOut(get_object_or_404(selectors.host_list(), name=name)).data)
