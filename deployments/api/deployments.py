"""/api/deployments/: create, read, change (a new generation), start, stop and
scale deployments, and read their revisions. What a deployment shows besides
itself (its timeline, GPU plan, rates, log and metrics) and the preflight are
deployments.api.deployment_state."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import replace
from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.generics import get_object_or_404
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from access.idempotency import idempotent
from common.errors import ValidationFailed
from core.api.base import StrictModelSerializer, StrictSerializer, validated
from core.api.lists import ListEndpoint
from core.permissions import ReadOrOperate
from core.validation import DB_INT_MAX, slug_validator
from deployments import selectors, states
from deployments.models import (
    AutoscaleMetric,
    Deployment,
    DeploymentModel,
    DeploymentRevision,
    DeploymentStatus,
    DesiredState,
    PlacementPolicy,
    Replica,
    Runtime,
)
from deployments.services import deployments as deployment_services
from deployments.services.autoscale import AUTOSCALE_OFF, AutoscaleSpec, describe
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
            "threads",
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
            "physical_gpus",
            "autoscale",
            "replica_set",
            "shm_size_mib",
            "log_verbose",
            "drain_timeout_s",
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
        fields = ["shm_size_mib", "log_verbose", "drain_timeout_s"]
        extra_kwargs = {name: {"required": False} for name in fields}


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
    physical_gpus = serializers.BooleanField(
        default=False,
        help_text="the models' gpu_ids are each host's own GPU indexes, never mapped onto other GPUs (as "
        "CUDA_VISIBLE_DEVICES pins a process); a host where those GPUs lack room takes no replica",
    )
    autoscale = AutoscaleIn(required=False, help_text="autoscaling between min and max replicas; off if absent")
    runtime = serializers.ChoiceField(choices=Runtime.choices, default=Runtime.PROCESS)
    image = serializers.CharField(max_length=255, required=False, default="", allow_blank=True)
    # ServerIn's fields (Deployment's bounds), re-instantiated for this serializer.
    shm_size_mib = copy.deepcopy(ServerIn().fields["shm_size_mib"])
    log_verbose = copy.deepcopy(ServerIn().fields["log_verbose"])
    drain_timeout_s = copy.deepcopy(ServerIn().fields["drain_timeout_s"])
    models = PlacementIn(many=True, allow_empty=False)


# The rows a page shows, by id: digits and commas only, so that the longest list
# still fits a request line (the web server refuses longer ones before Django).
IDS_MAX, IDS_CHARS = 200, 2000


def ids_of(value: str) -> list[int]:
    """A comma-separated list of at most IDS_MAX ids."""
    try:
        ids = [int(part) for part in value.split(",")]
    except ValueError:
        raise serializers.ValidationError("a comma-separated list of deployment ids") from None
    if len(ids) > IDS_MAX or any(not 1 <= i <= DB_INT_MAX for i in ids):
        raise serializers.ValidationError(f"at most {IDS_MAX} ids, each a positive integer")
    return ids


def ids_field(help_text: str) -> serializers.RegexField:
    return serializers.RegexField(
        r"^[0-9]{1,19}(,[0-9]{1,19})*$", max_length=IDS_CHARS, required=False, validators=[ids_of],
        help_text=help_text, error_messages={"invalid": "a comma-separated list of deployment ids"},
    )  # fmt: skip


class DeploymentQuery(StrictSerializer):
    host = serializers.CharField(max_length=63, required=False, help_text="with a replica on this host")
    ids = ids_field(f"only these (comma-separated, at most {IDS_MAX})")
    status = serializers.ChoiceField(choices=DeploymentStatus.choices, required=False)
    desired_state = serializers.ChoiceField(choices=DesiredState.choices, required=False)
    runtime = serializers.ChoiceField(choices=Runtime.choices, required=False)
    name = serializers.CharField(max_length=63, required=False, help_text="names containing this")


def creation(data: dict[str, Any]) -> dict[str, Any]:
    """deployment_create's (and deployment_preflight's) arguments from a checked DeploymentIn body."""
    if "host" in data and "hosts" in data:
        raise ValidationFailed({"host": "send host (one) or hosts (a list), not both"})
    return {
        "name": data["name"],
        "hosts": [data["host"]] if "host" in data else list(dict.fromkeys(data.get("hosts", []))),
        "replicas": data["replicas"],
        "placement_policy": data["placement_policy"],
        "physical_gpus": data["physical_gpus"],
        "autoscale": autoscale_spec(data["autoscale"]) if "autoscale" in data else AUTOSCALE_OFF,
        "runtime": data["runtime"],
        "image": data["image"],
        "placements": placement_specs(data["models"]),
        "server": server_spec(data),
    }


def as_sent(errors: dict[str, list[str]], data: dict[str, Any]) -> dict[str, list[str]]:
    """The service names the hosts "hosts"; a body that sent one "host" hears of that field."""
    if "host" not in data:
        return errors
    return {("host" if name == "hosts" else name): rules for name, rules in errors.items()}


def server_spec(data: dict[str, Any], current: Deployment | None = None) -> ServerSpec:
    """The server settings a body asks for; unset ones keep ``current``'s (or the defaults)."""
    names = [field.name for field in dataclasses.fields(ServerSpec)]
    base = ServerSpec() if current is None else ServerSpec(**{name: getattr(current, name) for name in names})
    return replace(base, **{name: data[name] for name in names if name in data})


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
            rows = rows.filter(pk__in=ids_of(query["ids"]))
        return rows.filter(name__contains=query["name"]) if "name" in query else rows

    @idempotent()
    @extend_schema(request=DeploymentIn, responses={201: DeploymentOut})
    def post(self, request: Request) -> Response:
        data = validated(DeploymentIn, request)
        try:
            deployment = deployment_services.deployment_create(**creation(data), user=request.user)
        except ValidationFailed as failed:
            raise ValidationFailed(as_sent(failed.errors, data)) from None
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
        """The server's settings (shm_size_mib, log_verbose, drain_timeout_s): taken at
        the next start, or now by a restart when it runs (a new drain timeout needs none)."""
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
