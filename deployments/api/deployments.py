"""/api/deployments/: create, read, change (a new generation), start and stop
deployments, and read their revisions, events, GPU plan, server log and metrics."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers, status
from rest_framework.generics import get_object_or_404
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from deployments import selectors, states
from deployments.api.base import StrictModelSerializer, StrictSerializer, int_param, require_empty_body, validated
from deployments.events import event_payload
from deployments.models import Deployment, DeploymentModel, Runtime, slug_validator
from deployments.permissions import ReadOrOperate
from deployments.services import deployments, telemetry
from deployments.services.placements import MAX_BATCH_SIZE, PLACEMENT_FIELDS, PlacementSpec


class PlacementOut(serializers.ModelSerializer):
    model = serializers.CharField(source="registered_model.name")
    kind = serializers.CharField(source="registered_model.kind")

    class Meta:
        model = DeploymentModel
        fields = [
            "triton_name",
            "model",
            "kind",
            "backend",
            "engine_build",
            "max_batch_size",
            "preferred_batch_sizes",
            "max_queue_delay_us",
            "priority_levels",
            "default_priority_level",
            "queue_timeout_us",
            "max_queue_size",
            "instance_count",
            "instance_kind",
            "gpu_ids",
            "gpu_memory_fraction",
            "batch_scheduler_policy",
            "decoupled",
            "kv_cache_tokens",
        ]


class DeploymentOut(serializers.ModelSerializer):
    host = serializers.CharField(source="host.name")
    host_online = serializers.BooleanField(source="host.is_online")
    shown_status = serializers.CharField()
    models = PlacementOut(source="placements", many=True)
    actions = serializers.SerializerMethodField(help_text="what may be asked of it now: start, stop, change")

    class Meta:
        model = Deployment
        fields = [
            "id",
            "name",
            "host",
            "runtime",
            "image",
            "http_port",
            "grpc_port",
            "metrics_port",
            "desired_state",
            "status",
            "shown_status",
            "host_online",
            "status_message",
            "status_changed_at",
            "generation",
            "models",
            "actions",
            "created_at",
        ]

    def get_actions(self, deployment: Deployment) -> dict[str, bool]:
        return states.deployment_actions(deployment.status)


class PlacementIn(StrictModelSerializer):
    """One model of a deployment. Fields, defaults and bounds come from
    DeploymentModel; unset fields take the model's defaults (PlacementSpec)."""

    model = serializers.CharField(max_length=63, help_text="a registered model's name")
    preferred_batch_sizes = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=MAX_BATCH_SIZE), max_length=16, required=False
    )
    gpu_ids = serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=63), max_length=64, required=False
    )
    engine_build = serializers.IntegerField(min_value=1, required=False, allow_null=True)
    llm_api = serializers.BooleanField(required=False)

    class Meta:
        model = DeploymentModel
        fields = list(PLACEMENT_FIELDS)
        extra_kwargs = {
            "triton_name": {"required": False, "allow_blank": True},
            **{name: {"required": False} for name in PLACEMENT_FIELDS if name not in ("model", "triton_name")},
        }

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        # Model-level validation (unique constraints over the deployment) is the service's job.
        return attrs


class PortsIn(StrictSerializer):
    http = serializers.IntegerField(min_value=1024, max_value=65535)
    grpc = serializers.IntegerField(min_value=1024, max_value=65535)
    metrics = serializers.IntegerField(min_value=1024, max_value=65535)


class DeploymentIn(StrictSerializer):
    name = serializers.CharField(max_length=63, validators=[slug_validator])
    host = serializers.CharField(max_length=63)
    runtime = serializers.ChoiceField(choices=Runtime.choices, default=Runtime.PROCESS)
    image = serializers.CharField(max_length=255, required=False, default="", allow_blank=True)
    ports = PortsIn(required=False)
    models = PlacementIn(many=True, allow_empty=False)


class DeploymentList(APIView):
    permission_classes = [ReadOrOperate]

    def get(self, request: Request) -> Response:
        return Response(DeploymentOut(selectors.deployment_list(), many=True).data)

    def post(self, request: Request) -> Response:
        data = validated(DeploymentIn, request)
        ports = data.get("ports")
        deployment = deployments.deployment_create(
            name=data["name"],
            host_name=data["host"],
            runtime=data["runtime"],
            image=data["image"],
            ports=(ports["http"], ports["grpc"], ports["metrics"]) if ports else None,
            placements=placement_specs(data["models"]),
            user=request.user,
        )
        deployment = selectors.deployment_list().get(pk=deployment.pk)
        return Response(DeploymentOut(deployment).data, status=status.HTTP_201_CREATED)


class DeploymentDetail(APIView):
    permission_classes = [ReadOrOperate]

    def get(self, request: Request, pk: int) -> Response:
        return Response(DeploymentOut(get_object_or_404(selectors.deployment_list(), pk=pk)).data)


class ModelsIn(StrictSerializer):
    models = PlacementIn(many=True, allow_empty=False)


def placement_specs(items: list[dict[str, Any]]) -> list[PlacementSpec]:
    return [PlacementSpec.from_fields(item) for item in items]


class DeploymentModels(APIView):
    """PUT /api/deployments/<id>/models/ {"models": [...]}: a new generation (202 when applied in place)."""

    permission_classes = [ReadOrOperate]

    def put(self, request: Request, pk: int) -> Response:
        data = validated(ModelsIn, request)
        deployments.deployment_change(deployment_id=pk, placements=placement_specs(data["models"]), user=request.user)
        return Response(DeploymentOut(selectors.deployment_list().get(pk=pk)).data, status=status.HTTP_202_ACCEPTED)


class DeploymentRevisions(APIView):
    permission_classes = [ReadOrOperate]

    def get(self, request: Request, pk: int) -> Response:
        deployment = get_object_or_404(Deployment, pk=pk)
        return Response(
            [
                {
                    "generation": r.generation,
                    "status": r.status,
                    "message": r.message,
                    "models": r.spec,
                    "created_at": r.created_at.isoformat(),
                }
                for r in deployment.revisions.order_by("generation")
            ]
        )


class DeploymentStart(APIView):
    """POST /api/deployments/<id>/start/ (no body): its host launches it."""

    permission_classes = [ReadOrOperate]

    def post(self, request: Request, pk: int) -> Response:
        require_empty_body(request)
        deployments.deployment_start(deployment_id=pk, user=request.user)
        return Response(DeploymentOut(selectors.deployment_list().get(pk=pk)).data, status=status.HTTP_202_ACCEPTED)


class DeploymentStop(APIView):
    """POST /api/deployments/<id>/stop/ (no body): its host stops its server."""

    permission_classes = [ReadOrOperate]

    def post(self, request: Request, pk: int) -> Response:
        require_empty_body(request)
        deployments.deployment_stop(deployment_id=pk, user=request.user)
        return Response(DeploymentOut(selectors.deployment_list().get(pk=pk)).data, status=status.HTTP_202_ACCEPTED)


class DeploymentEvents(APIView):
    permission_classes = [ReadOrOperate]

    def get(self, request: Request, pk: int) -> Response:
        get_object_or_404(Deployment, pk=pk)
        return Response([event_payload(e) for e in selectors.deployment_events(pk)])


class DeploymentPlan(APIView):
    """GET /api/deployments/<id>/plan/: GPU memory per model per GPU, against the headroom limit."""

    permission_classes = [ReadOrOperate]

    def get(self, request: Request, pk: int) -> Response:
        return Response(selectors.deployment_plan(get_object_or_404(selectors.deployment_list(), pk=pk)))


class DeploymentLog(APIView):
    """GET /api/deployments/<id>/log/?lines=200: the newest lines of the deployment's Triton log."""

    permission_classes = [ReadOrOperate]

    def get(self, request: Request, pk: int) -> Response:
        get_object_or_404(Deployment, pk=pk)
        count = int_param(request, "lines", default=200, high=telemetry.LOG_LINES_KEPT)
        return Response({"lines": selectors.deployment_log(pk, lines=count)})


class DeploymentMetrics(APIView):
    """GET /api/deployments/<id>/metrics/?minutes=N: the samples of the last N minutes (default 15)."""

    permission_classes = [ReadOrOperate]

    def get(self, request: Request, pk: int) -> Response:
        get_object_or_404(Deployment, pk=pk)
        minutes = int_param(request, "minutes", default=15, high=24 * 60)
        samples = selectors.deployment_metrics(pk, minutes=minutes)
        return Response(
            [{"at": s.at.isoformat(), "kind": s.kind, "subject": s.subject, "values": s.values} for s in samples]
        )
