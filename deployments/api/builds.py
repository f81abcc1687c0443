"""/api/builds/: request, follow and cancel engine builds."""

from __future__ import annotations

import functools
import operator
from datetime import tzinfo
from typing import Any, ClassVar

from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.generics import get_object_or_404
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from access.idempotency import idempotent
from core.api.base import StrictSerializer, require_empty_body, validated
from core.api.lists import CursorPage, ListEndpoint
from core.models import Event
from core.permissions import ReadOrOperate
from deployments import build_spec, selectors, states
from deployments.api.timeline import Events, LogLines
from deployments.models import BuildLogLine, BuildStatus, EngineBuild
from deployments.services import builds
from upstream import trtllm


class BuildOut(serializers.ModelSerializer):
    model = serializers.CharField(source="model.name")
    host = serializers.CharField(source="host.name")
    created_by = serializers.CharField(source="created_by.username", default=None)
    deployed_in = serializers.SerializerMethodField()
    actions = serializers.SerializerMethodField()

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
            "actions",
        ]

    # A row is what the list reads with values() (selectors.build_rows): the build's
    # own columns, and the related rows' names under these lookups.
    RELATED: ClassVar[dict[str, str]] = {"model": "model__name", "host": "host__name",
                                         "created_by": "created_by__username"}  # fmt: skip
    DERIVED: ClassVar[tuple[str, ...]] = ("deployed_in", "actions")
    STAMPS: ClassVar[tuple[str, ...]] = ("created_at", "started_at", "finished_at")

    @classmethod
    def row_columns(cls) -> list[str]:
        """The columns of a row, in the order of Meta.fields (a related row's name under its lookup)."""
        return [cls.RELATED.get(name, name) for name in cls.Meta.fields if name not in cls.DERIVED]

    @classmethod
    @functools.cache
    def _layout(cls) -> tuple[tuple[str, ...], Any]:
        """The output's names of a row's columns, and what takes those columns from a row, in order."""
        names = tuple(name for name in cls.Meta.fields if name not in cls.DERIVED)
        return names, operator.itemgetter(*map(selectors.build_row_key, cls.row_columns()))

    def row_of(self, build: EngineBuild) -> dict[str, Any]:
        """A model instance as a list row (selectors.build_rows), its JSON columns parsed."""
        row = {
            selectors.build_row_key(name): getattr(build, name)
            for name in self.row_columns()
            if name not in self.RELATED.values()
        }
        row["model__name"], row["host__name"] = build.model.name, build.host.name
        row["created_by__username"] = build.created_by.username if build.created_by_id else None
        return row

    def to_representation(self, build: EngineBuild | dict[str, Any]) -> dict[str, Any]:
        # DRF runs each field's machinery per row; on a 50-row page that was the
        # largest cost of the request, and model instances the next (docs/performance.md).
        # The same output, written directly from a row (the columns taken in one
        # C call, then the few that change); a unit test pins it to DRF's own.
        row = build if isinstance(build, dict) else self.row_of(build)
        names, columns = self._layout()
        out = dict(zip(names, columns(row), strict=True))
        stamp, zone = self._stamp, self._zone
        for name in self.STAMPS:
            out[name] = stamp(out[name], zone)
        out["deployed_in"] = self._deployed_in(row["id"])
        out["actions"] = states.build_actions(row["status"])
        return out

    @functools.cached_property
    def _zone(self) -> tzinfo:
        # Looked up once per response: each lookup goes through asgiref's Local.
        return timezone.get_current_timezone()

    @staticmethod
    def _stamp(value: Any, zone: tzinfo) -> str | None:
        # DRF's DateTimeField output (ISO 8601 in the current zone, UTC as Z)
        # without its per-value machinery; Gantry activates no other zone.
        if value is None:
            return None
        text = value.astimezone(zone).isoformat()
        return text[:-6] + "Z" if text.endswith("+00:00") else text

    def get_actions(self, build: EngineBuild) -> dict[str, bool]:
        return states.build_actions(build.status)

    def get_deployed_in(self, build: EngineBuild) -> list[dict[str, Any]]:
        return self._deployed_in(build.pk)

    def _deployed_in(self, build_id: int) -> list[dict[str, Any]]:
        # A list page reads them for all its builds at once (BuildList.page_context).
        known = self.context.get("deployed_in")
        return known[build_id] if known is not None else selectors.builds_deployed_in([build_id])[build_id]


class BuildRequestOut(BuildOut):
    how = serializers.ChoiceField(
        choices=["queued", "cached", "joined"],
        help_text="queued: a new build; cached: an identical build succeeded; joined: one is under way",
    )

    class Meta(BuildOut.Meta):
        fields = ["how", *BuildOut.Meta.fields]


class BuildSpecIn(StrictSerializer):
    """Types and ranges; the rules that need the checkpoint and host are in deployments.build_spec."""

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
    time_limit_s = serializers.IntegerField(min_value=build_spec.MIN_TIME_LIMIT_S, required=False, default=None)
    force = serializers.BooleanField(required=False, default=False)


class BuildReuseOut(serializers.Serializer):
    how = serializers.ChoiceField(choices=["cached", "joined"])
    build = serializers.IntegerField()


class BuildPreflightOut(serializers.Serializer):
    valid = serializers.BooleanField(help_text="true when POST /api/builds/ with this body would be accepted")
    errors = serializers.DictField(child=serializers.ListField(child=serializers.CharField()))
    spec = serializers.DictField(allow_null=True, help_text="the spec as it would be built (defaults filled in)")
    cache_key = serializers.CharField(allow_null=True)
    reuse = BuildReuseOut(allow_null=True, help_text="the build an identical request would be answered with")


class BuildPreflight(APIView):
    """POST /api/builds/preflight/: what requesting this build would say, with
    nothing written: every broken rule by field, or the spec as it would be
    built, its cache key, and whether an identical build would be reused
    (cached, or joined while it runs). The build form asks it as it is filled in."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=BuildIn, responses={200: BuildPreflightOut})
    def post(self, request: Request) -> Response:
        data = validated(BuildIn, request)
        return Response(builds.build_preflight(**_request_arguments(data), user=request.user))


def _request_arguments(data: dict[str, Any]) -> dict[str, Any]:
    """build_request's (and build_preflight's) arguments from a checked BuildIn body."""
    return {
        "model": data["model"],
        "host": data["host"],
        "image": data["image"],
        "spec": dict(data["spec"]),
        "time_limit_s": data["time_limit_s"],
        "force": data["force"],
    }


class BuildQuery(StrictSerializer):
    model = serializers.CharField(max_length=63, required=False, help_text="a registered model's name")
    status = serializers.ChoiceField(choices=BuildStatus.choices, required=False)
    host = serializers.CharField(max_length=63, required=False)
    cache_key = serializers.CharField(max_length=64, required=False)


class BuildList(ListEndpoint):
    """GET /api/builds/: newest first, a cursor page; POST a build request:
    201 queued, 200 with "how": "cached" or "joined" when an identical build is reused."""

    permission_classes = [ReadOrOperate]
    serializer_class = BuildOut
    pagination_class = CursorPage
    query_class = BuildQuery
    ordering_fields = ("id",)
    ordering = "-id"

    def get_queryset(self) -> QuerySet[EngineBuild]:
        return selectors.build_rows(BuildOut.row_columns())

    def filter_rows(self, rows: QuerySet[EngineBuild], query: dict[str, Any]) -> QuerySet[EngineBuild]:
        return selectors.build_filter(rows, **query)

    def page_context(self, page: list[dict[str, Any]]) -> dict[str, Any]:
        deployed = selectors.builds_deployed_in([row["id"] for row in page if row["deployed"]])
        return {"deployed_in": {row["id"]: deployed.get(row["id"], []) for row in page}}

    @idempotent()
    @extend_schema(request=BuildIn, responses={201: BuildRequestOut, 200: BuildRequestOut})
    def post(self, request: Request) -> Response:
        data = validated(BuildIn, request)
        build, how = builds.build_request(
            **_request_arguments(data),
            user=request.user,
        )
        code = status.HTTP_201_CREATED if how == "queued" else status.HTTP_200_OK
        build.how = how
        return Response(BuildRequestOut(build).data, status=code)


class BuildDetail(APIView):
    """GET one build; DELETE a finished one and its engine files (refused while it
    runs or is deployed)."""

    permission_classes = [ReadOrOperate]

    @extend_schema(responses={204: None})
    def delete(self, request: Request, pk: int) -> Response:
        builds.build_delete(build_id=pk, user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(responses=BuildOut)
    def get(self, request: Request, pk: int) -> Response:
        return Response(BuildOut(get_object_or_404(selectors.build_list(), pk=pk)).data)


class BuildCancel(APIView):
    permission_classes = [ReadOrOperate]

    @extend_schema(request=None, responses={202: BuildOut})
    def post(self, request: Request, pk: int) -> Response:
        require_empty_body(request)
        get_object_or_404(EngineBuild, pk=pk)
        build = builds.build_cancel(build_id=pk, user=request.user)
        return Response(BuildOut(build).data, status=status.HTTP_202_ACCEPTED)


class BuildLog(LogLines):
    """GET /api/builds/<id>/log/: the build's stored output, newest lines first
    (``?ordering=id`` for oldest first; ``after`` follows a running build)."""

    def get_queryset(self) -> QuerySet[BuildLogLine]:
        return BuildLogLine.objects.filter(build=get_object_or_404(EngineBuild, pk=self.kwargs["pk"]))


class BuildEvents(Events):
    """GET /api/builds/<id>/events/: the build's timeline, newest first."""

    def get_queryset(self) -> QuerySet[Event]:
        build = get_object_or_404(EngineBuild.objects.only("pk"), pk=self.kwargs["pk"])
        return selectors.event_rows().filter(build=build)
