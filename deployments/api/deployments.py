"""/api/deployments/: create, read, change (a new generation), start and stop
deployments, and read their revisions, events, GPU plan, server log and metrics."""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import timedelta
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.generics import get_object_or_404
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from access.idempotency import idempotent
from common.errors import ValidationFailed
from deployments import selectors, states
from deployments.api.base import StrictModelSerializer, StrictSerializer, require_empty_body, validated
from deployments.api.lists import CursorPage, ListEndpoint, checked_query
from deployments.api.timeline import Events, LogLines
from deployments.models import (
    DB_INT_MAX,
    AutoscaleMetric,
    Deployment,
    DeploymentModel,
    DeploymentRevision,
    DeploymentStatus,
    DesiredState,
    Event,
    LogLine,
    MetricSample,
    PlacementPolicy,
    Replica,
    Runtime,
    slug_validator,
)
from deployments.permissions import ReadOrOperate
from deployments.services import deployments as deployment_services
from deployments.services import telemetry
from deployments.services.autoscale import AUTOSCALE_OFF, AutoscaleSpec, deployment_autoscale_set, describe
from deployments.services.deployments import ServerSpec
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
            "timeout_action",
            "instance_count",
            "instance_kind",
            "gpu_ids",
            "gpu_memory_fraction",
            "dtype",
            "max_seq_len",
            "batch_scheduler_policy",
            "decoupled",
            "max_num_sequences",
            "kv_cache_free_gpu_mem_fraction",
            "max_tokens_in_paged_kv_cache",
            "enable_kv_cache_reuse",
            "decoding_mode",
            "kv_cache_tokens",
            "ready",
        ]


class ReplicaOut(serializers.ModelSerializer):
    host = serializers.CharField(source="host.name")
    host_online = serializers.BooleanField(source="host.is_online")
    shown_status = serializers.CharField()
    gpus = serializers.SerializerMethodField(help_text="the deployment's GPU numbers to the host's")

    class Meta:
        model = Replica
        fields = [
            "serial",
            "host",
            "host_online",
            "gpus",
            "http_port",
            "grpc_port",
            "metrics_port",
            "generation",
            "desired_state",
            "status",
            "shown_status",
            "status_message",
            "status_changed_at",
            "models_ready",
            "queue_ms",
            "in_flight",
        ]

    def get_gpus(self, replica: Replica) -> dict[str, int]:
        return {str(k): v for k, v in sorted(replica.gpus.items())}


class AutoscaleOut(serializers.Serializer):
    on = serializers.SerializerMethodField(help_text="whether autoscaling moves replicas (max_replicas is set)")
    min_replicas = serializers.IntegerField(allow_null=True)
    max_replicas = serializers.IntegerField(allow_null=True)
    metric = serializers.CharField(source="autoscale_metric")
    target = serializers.FloatField(source="autoscale_target")
    cooldown_s = serializers.IntegerField(source="autoscale_cooldown_s")
    scaled_at = serializers.DateTimeField(allow_null=True, help_text="when the replica count last changed")
    words = serializers.SerializerMethodField(help_text="the settings in words, as the page shows them")

    def get_on(self, deployment: Deployment) -> bool:
        return deployment.max_replicas is not None

    def get_words(self, deployment: Deployment) -> str:
        return describe(AutoscaleSpec.of(deployment))


class DeploymentOut(serializers.ModelSerializer):
    hosts = serializers.SlugRelatedField(
        source="pinned_hosts", many=True, read_only=True, slug_field="name",
        help_text="the hosts its replicas may run on (empty: any online host)",
    )  # fmt: skip
    models = PlacementOut(source="placements", many=True)
    replica_set = ReplicaOut(many=True, help_text="its replicas: one Triton each, on a host Gantry chose")
    autoscale = AutoscaleOut(source="*", help_text="autoscaling's settings (off while max_replicas is null)")
    actions = serializers.SerializerMethodField(help_text="what may be asked of it now: start, stop, change, scale")

    class Meta:
        model = Deployment
        fields = [
            "id",
            "name",
            "hosts",
            "runtime",
            "image",
            "replicas",
            "placement_policy",
            "autoscale",
            "replica_set",
            "shm_size_mib",
            "log_verbose",
            "desired_state",
            "status",
            "shown_status",
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


class ServerIn(StrictModelSerializer):
    """A deployment's tritonserver settings; bounds and defaults are Deployment's."""

    class Meta:
        model = Deployment
        fields = ["shm_size_mib", "log_verbose"]
        extra_kwargs = {"shm_size_mib": {"required": False}, "log_verbose": {"required": False}}


class AutoscaleIn(StrictSerializer):
    """Autoscaling's settings; bounds and defaults are Deployment's. Without
    max_replicas (or with it null) autoscaling is off."""

    min_replicas = serializers.IntegerField(min_value=1, max_value=64, required=False, allow_null=True, default=None)
    max_replicas = serializers.IntegerField(min_value=1, max_value=64, required=False, allow_null=True, default=None)
    metric = serializers.ChoiceField(
        choices=AutoscaleMetric.choices, default=AutoscaleMetric.IN_FLIGHT,
        help_text="what is held at the target per replica: requests in flight, or queue time (ms) per request",
    )  # fmt: skip
    target = serializers.FloatField(min_value=0.1, max_value=100_000, default=AutoscaleSpec.target)
    cooldown_s = serializers.IntegerField(
        min_value=5, max_value=86_400, default=AutoscaleSpec.cooldown_s,
        help_text="seconds after a change of the count before autoscaling changes it again",
    )  # fmt: skip


def autoscale_spec(data: dict[str, Any]) -> AutoscaleSpec:
    """The settings a checked AutoscaleIn body asks for."""
    return AutoscaleSpec(**data)


class DeploymentIn(StrictSerializer):
    name = serializers.CharField(max_length=63, validators=[slug_validator])
    host = serializers.CharField(
        max_length=63, required=False, help_text="one host to pin its replicas to (as hosts: [host])"
    )
    hosts = serializers.ListField(
        child=serializers.CharField(max_length=63), max_length=100, required=False,
        help_text="the hosts its replicas may run on; none: any online host with room",
    )  # fmt: skip
    replicas = serializers.IntegerField(min_value=1, max_value=64, default=1)
    placement_policy = serializers.ChoiceField(choices=PlacementPolicy.choices, default=PlacementPolicy.SPREAD)
    autoscale = AutoscaleIn(required=False, help_text="autoscaling between min and max replicas; off if absent")
    runtime = serializers.ChoiceField(choices=Runtime.choices, default=Runtime.PROCESS)
    image = serializers.CharField(max_length=255, required=False, default="", allow_blank=True)
    # ServerIn's fields (Deployment's bounds), re-instantiated for this serializer.
    shm_size_mib = copy.deepcopy(ServerIn().fields["shm_size_mib"])
    log_verbose = copy.deepcopy(ServerIn().fields["log_verbose"])
    models = PlacementIn(many=True, allow_empty=False)


# The rows a page shows, by id: digits and commas only, so that the longest list
# still fits a request line (the web server refuses longer ones before Django).
IDS_MAX, IDS_CHARS = 200, 2000


def _ids(value: str) -> list[int]:
    """A comma-separated list of at most IDS_MAX ids."""
    try:
        ids = [int(part) for part in value.split(",")]
    except ValueError:
        raise serializers.ValidationError("a comma-separated list of deployment ids") from None
    if len(ids) > IDS_MAX or any(not 1 <= i <= DB_INT_MAX for i in ids):
        raise serializers.ValidationError(f"at most {IDS_MAX} ids, each a positive integer")
    return ids


def _ids_field(help_text: str) -> serializers.RegexField:
    return serializers.RegexField(
        r"^[0-9]{1,19}(,[0-9]{1,19})*$", max_length=IDS_CHARS, required=False, validators=[_ids],
        help_text=help_text, error_messages={"invalid": "a comma-separated list of deployment ids"},
    )  # fmt: skip


class DeploymentQuery(StrictSerializer):
    host = serializers.CharField(max_length=63, required=False, help_text="with a replica on this host")
    ids = _ids_field(f"only these (comma-separated, at most {IDS_MAX})")
    status = serializers.ChoiceField(choices=DeploymentStatus.choices, required=False)
    desired_state = serializers.ChoiceField(choices=DesiredState.choices, required=False)
    runtime = serializers.ChoiceField(choices=Runtime.choices, required=False)
    name = serializers.CharField(max_length=63, required=False, help_text="names containing this")


def _creation(data: dict[str, Any]) -> dict[str, Any]:
    """deployment_create's (and deployment_preflight's) arguments from a checked DeploymentIn body."""
    if "host" in data and "hosts" in data:
        raise ValidationFailed({"host": "send host (one) or hosts (a list), not both"})
    return {
        "name": data["name"],
        "hosts": [data["host"]] if "host" in data else list(dict.fromkeys(data.get("hosts", []))),
        "replicas": data["replicas"],
        "placement_policy": data["placement_policy"],
        "autoscale": autoscale_spec(data["autoscale"]) if "autoscale" in data else AUTOSCALE_OFF,
        "runtime": data["runtime"],
        "image": data["image"],
        "placements": placement_specs(data["models"]),
        "server": server_spec(data),
    }


def _as_sent(errors: dict[str, list[str]], data: dict[str, Any]) -> dict[str, list[str]]:
    """The service names the hosts "hosts"; a body that sent one "host" hears of that field."""
    if "host" not in data:
        return errors
    return {("host" if name == "hosts" else name): rules for name, rules in errors.items()}


def server_spec(data: dict[str, Any], current: Deployment | None = None) -> ServerSpec:
    """The server settings a body asks for; unset ones keep ``current``'s (or the defaults)."""
    base = ServerSpec() if current is None else ServerSpec(shm_size_mib=current.shm_size_mib,
                                                             log_verbose=current.log_verbose)  # fmt: skip
    return replace(base, **{name: data[name] for name in ("shm_size_mib", "log_verbose") if name in data})


class DeploymentList(ListEndpoint):
    """GET /api/deployments/ (by name); POST a new deployment (stopped until started)."""

    permission_classes = [ReadOrOperate]
    serializer_class = DeploymentOut
    query_class = DeploymentQuery
    ordering_fields = ("name", "created_at", "status_changed_at", "id")
    ordering = "name"

    def get_queryset(self) -> QuerySet[Deployment]:
        return selectors.deployment_list()

    def filter_rows(self, rows: QuerySet[Deployment], query: dict[str, Any]) -> QuerySet[Deployment]:
        lookups = {"status": "status", "desired_state": "desired_state", "runtime": "runtime"}
        rows = rows.filter(**{lookups[k]: v for k, v in query.items() if k in lookups})
        if "host" in query:
            rows = rows.filter(pk__in=Replica.objects.filter(host__name=query["host"]).values("deployment_id"))
        if "ids" in query:
            rows = rows.filter(pk__in=_ids(query["ids"]))
        return rows.filter(name__contains=query["name"]) if "name" in query else rows

    @idempotent()
    @extend_schema(request=DeploymentIn, responses={201: DeploymentOut})
    def post(self, request: Request) -> Response:
        data = validated(DeploymentIn, request)
        try:
            deployment = deployment_services.deployment_create(**_creation(data), user=request.user)
        except ValidationFailed as failed:
            raise ValidationFailed(_as_sent(failed.errors, data)) from None
        return Response(DeploymentOut(selectors.deployment_shown(deployment)).data, status=status.HTTP_201_CREATED)


class DeploymentDetail(APIView):
    """GET one deployment with its replicas; DELETE it (only at rest and with no
    gateway alias on it; its name and ports are free again, its timeline stays)."""

    permission_classes = [ReadOrOperate]

    @extend_schema(responses={204: None})
    def delete(self, request: Request, pk: int) -> Response:
        deployment_services.deployment_delete(deployment_id=pk, user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(responses=DeploymentOut)
    def get(self, request: Request, pk: int) -> Response:
        return Response(DeploymentOut(get_object_or_404(selectors.deployment_list(), pk=pk)).data)

    @extend_schema(request=ServerIn, responses={202: DeploymentOut})
    def patch(self, request: Request, pk: int) -> Response:
        """The server's settings (shm_size_mib, log_verbose): taken at the next start, or
        now by a restart when it runs."""
        data = validated(ServerIn, request)
        current = get_object_or_404(Deployment, pk=pk)
        deployment = deployment_services.deployment_configure(
            deployment_id=pk, server=server_spec(data, current), user=request.user
        )
        return Response(DeploymentOut(selectors.deployment_shown(deployment)).data, status=status.HTTP_202_ACCEPTED)


class ModelsIn(StrictSerializer):
    models = PlacementIn(many=True, allow_empty=False)


def placement_specs(items: list[dict[str, Any]]) -> list[PlacementSpec]:
    return [PlacementSpec.from_fields(item) for item in items]


class DeploymentModels(APIView):
    """PUT /api/deployments/<id>/models/ {"models": [...]}: a new generation (202 when applied in place)."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=ModelsIn, responses={202: DeploymentOut})
    def put(self, request: Request, pk: int) -> Response:
        data = validated(ModelsIn, request)
        deployment = deployment_services.deployment_change(
            deployment_id=pk, placements=placement_specs(data["models"]), user=request.user
        )
        return Response(DeploymentOut(selectors.deployment_shown(deployment)).data, status=status.HTTP_202_ACCEPTED)


class RevisionOut(serializers.ModelSerializer):
    models = serializers.JSONField(source="spec", help_text="the placements of this generation")

    class Meta:
        model = DeploymentRevision
        fields = ["generation", "status", "message", "models", "created_at"]


class DeploymentRevisions(ListEndpoint):
    """GET /api/deployments/<id>/revisions/: every generation, oldest first."""

    permission_classes = [ReadOrOperate]
    serializer_class = RevisionOut
    ordering_fields = ("generation",)
    ordering = "generation"

    def get_queryset(self) -> QuerySet[DeploymentRevision]:
        return DeploymentRevision.objects.filter(deployment=get_object_or_404(Deployment, pk=self.kwargs["pk"]))


class DeploymentStart(APIView):
    """POST /api/deployments/<id>/start/ (no body): its replicas start on hosts
    with room; refused (409, nothing started) when one fits nowhere."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=None, responses={202: DeploymentOut})
    def post(self, request: Request, pk: int) -> Response:
        require_empty_body(request)
        deployment = deployment_services.deployment_start(deployment_id=pk, user=request.user)
        return Response(DeploymentOut(selectors.deployment_shown(deployment)).data, status=status.HTTP_202_ACCEPTED)


class DeploymentRestart(APIView):
    """POST /api/deployments/<id>/restart/ (no body): stop its server and start it
    again (a failed one is started)."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=None, responses={202: DeploymentOut})
    def post(self, request: Request, pk: int) -> Response:
        require_empty_body(request)
        deployment = deployment_services.deployment_restart(deployment_id=pk, user=request.user)
        return Response(DeploymentOut(selectors.deployment_shown(deployment)).data, status=status.HTTP_202_ACCEPTED)


class RollbackIn(StrictSerializer):
    generation = serializers.IntegerField(min_value=1, help_text="an earlier generation (see revisions)")


class DeploymentRollback(APIView):
    """POST /api/deployments/<id>/rollback/ {"generation": N}: a new generation
    with generation N's models, applied like any change."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=RollbackIn, responses={202: DeploymentOut})
    def post(self, request: Request, pk: int) -> Response:
        data = validated(RollbackIn, request)
        deployment = deployment_services.deployment_roll_back_to(
            deployment_id=pk, generation=data["generation"], user=request.user
        )
        return Response(DeploymentOut(selectors.deployment_shown(deployment)).data, status=status.HTTP_202_ACCEPTED)


class ScaleIn(StrictSerializer):
    replicas = serializers.IntegerField(min_value=1, max_value=64, help_text="how many Triton servers serve it")


class DeploymentScale(APIView):
    """POST /api/deployments/<id>/scale/ {"replicas": N}: a running deployment
    places the new replicas on hosts with room (or is refused, with the closest
    host's shortfall) or retires the surplus; one at rest takes N at its start."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=ScaleIn, responses={202: DeploymentOut})
    def post(self, request: Request, pk: int) -> Response:
        data = validated(ScaleIn, request)
        deployment = deployment_services.deployment_scale(
            deployment_id=pk, replicas=data["replicas"], user=request.user
        )
        return Response(DeploymentOut(selectors.deployment_shown(deployment)).data, status=status.HTTP_202_ACCEPTED)


class DeploymentAutoscale(APIView):
    """POST /api/deployments/<id>/autoscale/ {"min_replicas": 1, "max_replicas": 4,
    "metric": "in_flight", "target": 4, "cooldown_s": 60}: turn autoscaling on or
    change it; {"max_replicas": null} turns it off. A count outside the new
    bounds is moved inside them."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=AutoscaleIn, responses={202: DeploymentOut})
    def post(self, request: Request, pk: int) -> Response:
        spec = autoscale_spec(validated(AutoscaleIn, request))
        deployment = deployment_autoscale_set(deployment_id=pk, spec=spec, user=request.user)
        return Response(DeploymentOut(selectors.deployment_shown(deployment)).data, status=status.HTTP_202_ACCEPTED)


class DeploymentStop(APIView):
    """POST /api/deployments/<id>/stop/ (no body): every replica's host stops its server."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=None, responses={202: DeploymentOut})
    def post(self, request: Request, pk: int) -> Response:
        require_empty_body(request)
        deployment = deployment_services.deployment_stop(deployment_id=pk, user=request.user)
        return Response(DeploymentOut(selectors.deployment_shown(deployment)).data, status=status.HTTP_202_ACCEPTED)


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
            **_creation(data), replaces=data.get("replaces"), user=request.user
        )
        return Response({**found, "errors": _as_sent(found["errors"], data)})


class RatesQuery(StrictSerializer):
    minutes = serializers.IntegerField(min_value=1, max_value=60, default=10, help_text="how far back (default 10)")
    ids = _ids_field(f"only these deployments (comma-separated, at most {IDS_MAX}; the rows a page shows)")


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
        ids = _ids(query["ids"]) if "ids" in query else None
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
