"""What a deployment shows besides itself: its timeline, its GPU plan (and a
would-be deployment's: the preflight), request rates, the server's log and
metric samples. The deployment itself is deployments.api.deployments."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.generics import get_object_or_404
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api.base import StrictSerializer, validated
from core.api.lists import CursorPage, ListEndpoint, checked_query
from core.models import Event
from core.permissions import ReadOrOperate
from core.validation import slug_validator
from deployments import selectors
from deployments.api.deployments import IDS_MAX, DeploymentIn, as_sent, creation, ids_field, ids_of
from deployments.api.timeline import Events, LogLines
from deployments.models import Deployment, LogLine, MetricSample
from deployments.services import deployments as deployment_services
from deployments.services import telemetry


class DeploymentEvents(Events):
    """GET /api/deployments/<id>/events/: the deployment's timeline, newest first."""

    def get_queryset(self) -> QuerySet[Event]:
        deployment = get_object_or_404(Deployment.objects.only("pk"), pk=self.kwargs["pk"])
        return selectors.event_rows().filter(deployment=deployment)


class PlannedModelOut(serializers.Serializer):
    deployment = serializers.CharField(help_text='the deployment and its replica ("chat r2")')
    deployment_id = serializers.IntegerField(allow_null=True, help_text="null: the unsaved one a preflight checks")
    replica = serializers.IntegerField(help_text="the replica's serial (0 or less: one not placed yet)")
    deployment_status = serializers.CharField()
    own = serializers.BooleanField(help_text="placed by the deployment asked about (else by another on the host)")
    triton_name = serializers.CharField()
    backend = serializers.CharField()
    fraction = serializers.FloatField()
    instances = serializers.IntegerField()
    share = serializers.FloatField(help_text="the fraction times the instances that each cap themselves at it")
    bytes = serializers.IntegerField()
    processes = serializers.IntegerField(help_text="server processes it adds on this GPU")
    nvml_budget_bytes = serializers.IntegerField(help_text="the most NVML may show them hold: share and contexts")
    engine_bytes = serializers.IntegerField(required=False, allow_null=True)
    weights_bytes = serializers.IntegerField(required=False, allow_null=True)
    kv_cache_tokens = serializers.IntegerField(required=False, allow_null=True)
    kv_cache_bytes = serializers.IntegerField(required=False, allow_null=True)
    activation_bytes = serializers.IntegerField(required=False, allow_null=True)


class GpuPlanOut(serializers.Serializer):
    host = serializers.CharField(required=False, help_text="the host of the replica this GPU plan is for")
    replica = serializers.IntegerField(required=False, help_text="that replica's serial")
    gpu = serializers.IntegerField()
    name = serializers.CharField()
    uuid = serializers.CharField()
    memory_total_bytes = serializers.IntegerField()
    models = PlannedModelOut(many=True)
    fraction = serializers.FloatField(help_text="the sum of the models' shares on this GPU")
    headroom = serializers.FloatField()
    within_headroom = serializers.BooleanField()
    processes = serializers.IntegerField(help_text="server processes on this GPU, tritonserver's included")
    process_reserve_bytes = serializers.IntegerField(help_text="the CUDA context each is planned to hold")
    contexts_fit = serializers.BooleanField(help_text="whether what the shares leave holds those contexts")
    problems = serializers.ListField(child=serializers.CharField())


class DeploymentPlan(APIView):
    """GET /api/deployments/<id>/plan/: GPU memory per model per GPU, against the headroom limit."""

    permission_classes = [ReadOrOperate]

    @extend_schema(responses=GpuPlanOut(many=True))
    def get(self, request: Request, pk: int) -> Response:
        return Response(selectors.deployment_plan(get_object_or_404(selectors.deployment_list(), pk=pk)))


class DeploymentPreflightIn(DeploymentIn):
    name = serializers.CharField(
        max_length=63, validators=[slug_validator], required=False, default="", allow_blank=True,
        help_text="checked against existing deployments when given",
    )  # fmt: skip
    replaces = serializers.IntegerField(
        required=False, min_value=1, help_text="a deployment whose models these would replace (a change): "
        "the host's plan leaves its current ones out",
    )  # fmt: skip


class ReplicaPlanOut(serializers.Serializer):
    replica = serializers.IntegerField()
    host = serializers.CharField(allow_null=True, help_text="null: it fits on no host now")
    gpus = serializers.DictField(child=serializers.IntegerField(), required=False,
                                 help_text="the deployment's GPU numbers to the host's")  # fmt: skip
    problem = serializers.CharField(required=False, help_text="the closest host's shortfall")


class DeploymentPreflightOut(serializers.Serializer):
    valid = serializers.BooleanField(help_text="true when POST /api/deployments/ with this body would create it")
    errors = serializers.DictField(
        child=serializers.ListField(child=serializers.CharField()),
        help_text="each broken rule by field, as a 400 of the create would name it (models[i].field)",
    )
    plan = GpuPlanOut(many=True, help_text="the first replica's host's GPU plan with the placements that passed")
    replicas = ReplicaPlanOut(many=True, help_text="where each replica would go now")
    warnings = serializers.ListField(
        child=serializers.CharField(), help_text="what the hosts' other replicas would make a start refuse"
    )


class DeploymentPreflight(APIView):
    """POST /api/deployments/preflight/: what creating this deployment would say,
    with nothing written: every broken rule by field, and the GPU plan (each
    model's share of each GPU against the headroom, an engine's KV-cache
    tokens). The deploy form asks it as it is filled in."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=DeploymentPreflightIn, responses={200: DeploymentPreflightOut})
    def post(self, request: Request) -> Response:
        data = validated(DeploymentPreflightIn, request)
        found = deployment_services.deployment_preflight(
            **creation(data), replaces=data.get("replaces"), user=request.user
        )
        return Response({**found, "errors": as_sent(found["errors"], data)})


class RatesQuery(StrictSerializer):
    minutes = serializers.IntegerField(min_value=1, max_value=60, default=10, help_text="how far back (default 10)")
    ids = ids_field(f"only these deployments (comma-separated, at most {IDS_MAX}; the rows a page shows)")


class RatePointOut(serializers.Serializer):
    at = serializers.DateTimeField()
    request_rate = serializers.FloatField(help_text="requests per second, all the deployment's models together")


class DeploymentRatesOut(serializers.Serializer):
    deployment = serializers.IntegerField()
    points = RatePointOut(many=True)


class DeploymentRates(APIView):
    """GET /api/deployments/rates/?minutes=10&ids=1,2: each deployment's (or
    those named) requests per second over the last minutes, oldest first (the
    dashboard's sparklines, for the rows in view)."""

    permission_classes = [ReadOrOperate]

    @extend_schema(parameters=[RatesQuery], responses=DeploymentRatesOut(many=True))
    def get(self, request: Request) -> Response:
        query = checked_query(RatesQuery, request.query_params)
        ids = ids_of(query["ids"]) if "ids" in query else None
        rates = telemetry.request_rates(minutes=query["minutes"], ids=ids)
        return Response(
            [
                {"deployment": deployment_id, "points": [{"at": at, "request_rate": rate} for at, rate in points]}
                for deployment_id, points in sorted(rates.items())
            ]
        )


class DeploymentLog(LogLines):
    """GET /api/deployments/<id>/log/: the Triton server's log, newest lines first
    (``?ordering=id`` for oldest first; ``after`` follows it)."""

    def get_queryset(self) -> QuerySet[LogLine]:
        return LogLine.objects.filter(deployment=get_object_or_404(Deployment, pk=self.kwargs["pk"]))


class MetricOut(serializers.ModelSerializer):
    replica = serializers.IntegerField(
        source="replica.serial", default=None, help_text="the serial of the replica whose server reported it"
    )

    class Meta:
        model = MetricSample
        fields = ["id", "at", "kind", "replica", "subject", "values"]


class MetricQuery(StrictSerializer):
    minutes = serializers.IntegerField(
        min_value=1, max_value=7 * 24 * 60, required=False, default=15, help_text="how far back (default 15)"
    )
    kind = serializers.ChoiceField(choices=MetricSample.Kind.choices, required=False)
    subject = serializers.CharField(max_length=128, required=False, help_text="a Triton model name, or a GPU uuid")
    after = serializers.IntegerField(min_value=0, required=False, help_text="only samples with a greater id")


class DeploymentMetrics(ListEndpoint):
    """GET /api/deployments/<id>/metrics/: the samples of the last ``minutes``, oldest first, a cursor page."""

    permission_classes = [ReadOrOperate]
    serializer_class = MetricOut
    pagination_class = CursorPage
    query_class = MetricQuery
    ordering_fields = ("id",)
    ordering = "id"

    def get_queryset(self) -> QuerySet[MetricSample]:
        deployment = get_object_or_404(Deployment, pk=self.kwargs["pk"])
        return MetricSample.objects.filter(deployment=deployment).select_related("replica")

    def filter_rows(self, rows: QuerySet[MetricSample], query: dict[str, Any]) -> QuerySet[MetricSample]:
        rows = rows.filter(at__gte=timezone.now() - timedelta(minutes=query["minutes"]))
        for field in ("kind", "subject"):
            if field in query:
                rows = rows.filter(**{field: query[field]})
        return rows.filter(id__gt=query["after"]) if "after" in query else rows
