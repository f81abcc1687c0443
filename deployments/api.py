"""The REST API under /api/: thin views over selectors and services."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from rest_framework import serializers, status
from rest_framework.exceptions import ValidationError as DRFValidationError
from rest_framework.generics import get_object_or_404
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView
from rest_framework.views import exception_handler as drf_exception_handler

from deployments import builds, selectors, services, trtllm
from deployments.errors import InvalidTransition, NotFound, PermissionDenied, ValidationFailed
from deployments.events import event_payload
from deployments.models import (
    Deployment,
    DeploymentModel,
    EngineBuild,
    Gpu,
    GpuHost,
    InstanceKind,
    ModelKind,
    RegisteredModel,
    Runtime,
    SchedulerPolicy,
)
from deployments.permissions import ReadOrOperate

_STATUS_FOR = {
    ValidationFailed: status.HTTP_400_BAD_REQUEST,
    NotFound: status.HTTP_404_NOT_FOUND,
    PermissionDenied: status.HTTP_403_FORBIDDEN,
    InvalidTransition: status.HTTP_409_CONFLICT,
}


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Map Gantry's errors to status codes; keep a ``detail`` line on every error."""
    for error_type, code in _STATUS_FOR.items():
        if isinstance(exc, error_type):
            body: dict[str, Any] = {"detail": str(exc)}
            if isinstance(exc, ValidationFailed):
                body["errors"] = exc.errors
            return Response(body, status=code)
    response = drf_exception_handler(exc, context)
    if response is not None and isinstance(exc, DRFValidationError):
        response.data = {"detail": _flatten(exc.detail), "errors": exc.detail}
    return response


def _flatten(detail: Any, prefix: str = "") -> str:
    if isinstance(detail, dict):
        return "; ".join(_flatten(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}") for k, v in detail.items())
    if isinstance(detail, list):
        if all(not isinstance(item, (dict, list)) for item in detail):
            return f"{prefix}: {' '.join(str(item) for item in detail)}" if prefix else " ".join(map(str, detail))
        return "; ".join(_flatten(item, f"{prefix}[{i}]") for i, item in enumerate(detail) if item)
    return f"{prefix}: {detail}" if prefix else str(detail)


class StrictSerializer(serializers.Serializer):
    """Refuses fields it does not know, so a typo is an error, not a silent default."""

    def to_internal_value(self, data: Any) -> Any:
        unknown = sorted(set(data) - set(self.fields)) if isinstance(data, dict) else []
        unknown_errors = {name: ["is not a known field"] for name in unknown}
        try:
            value = super().to_internal_value(data)
        except DRFValidationError as exc:
            errors = exc.detail if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail}
            raise DRFValidationError({**errors, **unknown_errors}) from exc
        if unknown_errors:
            raise DRFValidationError(unknown_errors)
        return value


# --- read shapes -------------------------------------------------------------


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
    queue = serializers.CharField(read_only=True)

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
            "gpus",
        ]


class ModelOut(serializers.ModelSerializer):
    host = serializers.CharField(source="host.name", default=None)

    class Meta:
        model = RegisteredModel
        fields = [
            "id",
            "name",
            "kind",
            "path",
            "hub_id",
            "revision",
            "architecture",
            "host",
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
            "created_at",
        ]


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
            "created_at",
        ]


# --- write shapes ------------------------------------------------------------

_slug = serializers.RegexField(
    r"^[a-z0-9][a-z0-9_.-]{0,62}$",
    error_messages={"invalid": "use 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit"},
)


class ModelIn(StrictSerializer):
    name = _slug
    kind = serializers.ChoiceField(choices=ModelKind.choices)
    host = serializers.CharField(max_length=63, help_text="the GPU host that holds the checkpoint")
    path = serializers.CharField(max_length=1024)
    hub_id = serializers.CharField(max_length=255, required=False, default="", allow_blank=True)
    revision = serializers.CharField(max_length=64, required=False, default="", allow_blank=True)


class PlacementIn(StrictSerializer):
    model = serializers.CharField(max_length=63)
    triton_name = serializers.RegexField(r"^[a-z0-9][a-z0-9_.-]{0,62}$", required=False, default="", allow_blank=True)
    max_batch_size = serializers.IntegerField(min_value=1, max_value=4096, default=32)
    preferred_batch_sizes = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=4096), max_length=16, default=list
    )
    max_queue_delay_us = serializers.IntegerField(min_value=0, max_value=10_000_000, default=2000)
    priority_levels = serializers.IntegerField(min_value=0, max_value=16, default=0)
    default_priority_level = serializers.IntegerField(min_value=0, max_value=16, default=0)
    queue_timeout_us = serializers.IntegerField(min_value=0, max_value=3_600_000_000, default=0)
    max_queue_size = serializers.IntegerField(min_value=0, max_value=1_000_000, default=0)
    instance_count = serializers.IntegerField(min_value=1, max_value=64, default=1)
    instance_kind = serializers.ChoiceField(choices=InstanceKind.choices, default=InstanceKind.AUTO)
    gpu_ids = serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=63), max_length=64, default=list
    )
    gpu_memory_fraction = serializers.FloatField(min_value=0.01, max_value=1.0, default=0.1)
    engine_build = serializers.IntegerField(min_value=1, required=False, default=None, allow_null=True)
    llm_api = serializers.BooleanField(default=False)
    batch_scheduler_policy = serializers.ChoiceField(
        choices=SchedulerPolicy.choices, default=SchedulerPolicy.GUARANTEED_NO_EVICT
    )
    decoupled = serializers.BooleanField(default=True)


class PortsIn(StrictSerializer):
    http = serializers.IntegerField(min_value=1024, max_value=65535)
    grpc = serializers.IntegerField(min_value=1024, max_value=65535)
    metrics = serializers.IntegerField(min_value=1024, max_value=65535)


class DeploymentIn(StrictSerializer):
    name = _slug
    host = serializers.CharField(max_length=63)
    runtime = serializers.ChoiceField(choices=Runtime.choices, default=Runtime.PROCESS)
    image = serializers.CharField(max_length=255, required=False, default="", allow_blank=True)
    ports = PortsIn(required=False)
    models = PlacementIn(many=True, allow_empty=False)


# --- views -------------------------------------------------------------------


class HostList(APIView):
    permission_classes = [ReadOrOperate]

    def get(self, request: Request) -> Response:
        return Response(HostOut(selectors.host_list(), many=True).data)


class HostDetail(APIView):
    permission_classes = [ReadOrOperate]

    def get(self, request: Request, name: str) -> Response:
        return Response(HostOut(get_object_or_404(selectors.host_list(), name=name)).data)


class ModelList(APIView):
    permission_classes = [ReadOrOperate]

    def get(self, request: Request) -> Response:
        return Response(ModelOut(selectors.model_list(), many=True).data)

    def post(self, request: Request) -> Response:
        data = validated(ModelIn, request)
        model = services.model_register(user=request.user, **data)
        return Response(ModelOut(model).data, status=status.HTTP_201_CREATED)


class ModelDetail(APIView):
    permission_classes = [ReadOrOperate]

    def get(self, request: Request, pk: int) -> Response:
        return Response(ModelOut(get_object_or_404(selectors.model_list(), pk=pk)).data)


class DeploymentList(APIView):
    permission_classes = [ReadOrOperate]

    def get(self, request: Request) -> Response:
        return Response(DeploymentOut(selectors.deployment_list(), many=True).data)

    def post(self, request: Request) -> Response:
        data = validated(DeploymentIn, request)
        ports = data.get("ports")
        deployment = services.deployment_create(
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


def placement_specs(items: list[dict[str, Any]]) -> list[services.PlacementSpec]:
    return [
        services.PlacementSpec(
            **{**p, "preferred_batch_sizes": tuple(p["preferred_batch_sizes"]), "gpu_ids": tuple(p["gpu_ids"])}
        )
        for p in items
    ]


class DeploymentModels(APIView):
    """PUT /api/deployments/<id>/models/ {"models": [...]}: a new generation (202 when applied in place)."""

    permission_classes = [ReadOrOperate]

    def put(self, request: Request, pk: int) -> Response:
        data = validated(ModelsIn, request)
        services.deployment_change(deployment_id=pk, placements=placement_specs(data["models"]), user=request.user)
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


class DeploymentAction(APIView):
    """POST /api/deployments/<id>/start/ or /stop/ (no body)."""

    permission_classes = [ReadOrOperate]
    action: str = ""

    def post(self, request: Request, pk: int) -> Response:
        if request.data:
            raise DRFValidationError({"body": ["must be empty"]})
        service = {"start": services.deployment_start, "stop": services.deployment_stop}[self.action]
        service(deployment_id=pk, user=request.user)
        deployment = selectors.deployment_list().get(pk=pk)
        return Response(DeploymentOut(deployment).data, status=status.HTTP_202_ACCEPTED)


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
        count = int_param(request, "lines", default=200, high=services.LOG_LINES_KEPT)
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


# --- engine builds ---------------------------------------------------------------


class BuildOut(serializers.ModelSerializer):
    model = serializers.CharField(source="model.name")
    host = serializers.CharField(source="host.name")
    created_by = serializers.CharField(source="created_by.username", default=None)
    deployed_in = serializers.SerializerMethodField()

    class Meta:
        model = EngineBuild
        fields = [
            "id",
            "model",
            "host",
            "status",
            "status_message",
            "phase",
            "exit_code",
            "hint",
            "spec",
            "executor",
            "builder_image",
            "image_digest",
            "trtllm_version",
            "gpu_name",
            "compute_capability",
            "gpu_ids",
            "tp_size",
            "pp_size",
            "cache_key",
            "forced",
            "time_limit_s",
            "output_dir",
            "artifacts",
            "build_config",
            "plugin_config",
            "created_by",
            "created_at",
            "started_at",
            "finished_at",
            "deployed_in",
        ]

    def get_deployed_in(self, build: EngineBuild) -> list[dict[str, Any]]:
        return [
            {"deployment": p.deployment_id, "name": p.deployment.name, "triton_name": p.triton_name}
            for p in build.placements.select_related("deployment")
        ]


class BuildSpecIn(StrictSerializer):
    """Types and ranges; the rules that need the checkpoint and host are in deployments.builds."""

    dtype = serializers.ChoiceField(choices=trtllm.DTYPES, required=False)
    quantization = serializers.ChoiceField(choices=trtllm.QUANTIZATIONS, required=False)
    gemm_plugin = serializers.ChoiceField(choices=trtllm.PLUGIN_CHOICES, required=False)
    gpt_attention_plugin = serializers.ChoiceField(choices=trtllm.PLUGIN_CHOICES, required=False)
    context_fmha = serializers.BooleanField(required=False)
    paged_context_fmha = serializers.BooleanField(required=False)
    remove_input_padding = serializers.BooleanField(required=False)
    max_batch_size = serializers.IntegerField(min_value=1, max_value=4096, required=False)
    max_input_len = serializers.IntegerField(min_value=1, max_value=1_048_576, required=False)
    max_seq_len = serializers.IntegerField(min_value=1, max_value=1_048_576, required=False)
    max_num_tokens = serializers.IntegerField(min_value=1, max_value=1_048_576, required=False)
    max_beam_width = serializers.IntegerField(min_value=1, max_value=32, required=False)
    tp_size = serializers.IntegerField(min_value=1, max_value=64, required=False)
    pp_size = serializers.IntegerField(min_value=1, max_value=64, required=False)
    workers = serializers.IntegerField(min_value=1, max_value=64, required=False)
    gpu_ids = serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=63), max_length=64, required=False
    )
    allow_seq_len_over_max_positions = serializers.BooleanField(required=False)


class BuildIn(StrictSerializer):
    model = serializers.CharField(max_length=63)
    host = serializers.CharField(max_length=63)
    image = serializers.CharField(max_length=255, help_text="an allow-listed builder image, or 'native'")
    spec = BuildSpecIn(required=False, default=dict)
    time_limit_s = serializers.IntegerField(min_value=builds.MIN_TIME_LIMIT_S, required=False, default=None)
    force = serializers.BooleanField(required=False, default=False)


class BuildList(APIView):
    """GET /api/builds/ (filters: model, status, host); POST a build request:
    201 queued, 200 with "how": "cached" or "joined" when an identical build is reused."""

    permission_classes = [ReadOrOperate]

    def get(self, request: Request) -> Response:
        found = selectors.build_list(
            model=request.query_params.get("model"),
            status=request.query_params.get("status"),
            host=request.query_params.get("host"),
        )
        return Response(BuildOut(found, many=True).data)

    def post(self, request: Request) -> Response:
        data = validated(BuildIn, request)
        build, how = builds.build_request(
            model=data["model"],
            host=data["host"],
            image=data["image"],
            spec=dict(data["spec"]),
            time_limit_s=data["time_limit_s"],
            force=data["force"],
            user=request.user,
        )
        code = status.HTTP_201_CREATED if how == "queued" else status.HTTP_200_OK
        return Response({"how": how, **BuildOut(build).data}, status=code)


class BuildDetail(APIView):
    permission_classes = [ReadOrOperate]

    def get(self, request: Request, pk: int) -> Response:
        return Response(BuildOut(get_object_or_404(selectors.build_list(), pk=pk)).data)


class BuildCancel(APIView):
    permission_classes = [ReadOrOperate]

    def post(self, request: Request, pk: int) -> Response:
        get_object_or_404(EngineBuild, pk=pk)
        build = builds.build_cancel(build_id=pk, user=request.user)
        return Response(BuildOut(build).data, status=status.HTTP_202_ACCEPTED)


class BuildLog(APIView):
    """GET /api/builds/<id>/log/?lines=500: the newest stored lines of the build's output."""

    permission_classes = [ReadOrOperate]

    def get(self, request: Request, pk: int) -> Response:
        get_object_or_404(EngineBuild, pk=pk)
        count = int_param(request, "lines", default=500, high=settings.GANTRY_BUILD_LOG_LINES)
        return Response({"lines": selectors.build_log(pk, lines=count)})


class BuildEvents(APIView):
    permission_classes = [ReadOrOperate]

    def get(self, request: Request, pk: int) -> Response:
        get_object_or_404(EngineBuild, pk=pk)
        return Response([event_payload(e) for e in selectors.build_events(pk)])


def int_param(request: Request, name: str, *, default: int, high: int) -> int:
    """An integer query parameter between 1 and ``high``, or a 400 naming it and the rule."""
    try:
        value = int(request.query_params.get(name, str(default)))
    except ValueError as exc:
        raise DRFValidationError({name: ["must be an integer"]}) from exc
    if not 1 <= value <= high:
        raise DRFValidationError({name: [f"must be between 1 and {high}"]})
    return value


def validated(serializer_class: type[serializers.Serializer], request: Request) -> dict[str, Any]:
    if not isinstance(request.data, dict):
        raise DRFValidationError({"body": ["must be a JSON object"]})
    serializer = serializer_class(data=request.data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data
