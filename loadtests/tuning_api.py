"""/api/tuning/: start, follow, cancel, apply and export tuning runs."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from django.db.models import QuerySet
from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from access.idempotency import idempotent
from deployments.api.base import StrictSerializer, require_empty_body, validated
from deployments.api.lists import CursorPage, ListEndpoint, checked_query
from deployments.permissions import ReadOrOperate
from loadtests import selectors, tuning
from loadtests import tuning_services as services
from loadtests import workload as w
from loadtests.api import ThresholdsIn
from loadtests.models import RunStatus, TuningRun, TuningTrial


class MixIn(StrictSerializer):
    """One alias of the traffic mix: its request rate, its requests' shape, and
    the p99 targets a request must meet to count towards goodput."""

    model = serializers.CharField(max_length=128, help_text="a gateway alias of this deployment")
    rate = serializers.FloatField(min_value=0.01, max_value=w.MAX_RATE, help_text="requests per second (Poisson)")
    input_tokens = serializers.IntegerField(min_value=1, max_value=32_768, required=False)
    output_tokens = serializers.IntegerField(min_value=1, max_value=8192, required=False)
    batch_size = serializers.IntegerField(min_value=1, max_value=256, required=False)
    passages = serializers.IntegerField(min_value=1, max_value=100, required=False)
    dataset = serializers.ListField(
        child=serializers.CharField(max_length=w.MAX_DATASET_ENTRY_CHARS, trim_whitespace=False),
        min_length=1,
        max_length=w.MAX_DATASET_ENTRIES,
        required=False,
        help_text="your own prompts (LLM) or sentences (embedder), used in turn",
    )
    targets = ThresholdsIn(help_text="p99 targets, ms: TTFT and inter-token (LLM), request latency (any)")


class TuningIn(StrictSerializer):
    deployment = serializers.IntegerField(min_value=1)
    mix = serializers.ListField(child=MixIn(), min_length=1, max_length=8)
    space = serializers.DictField(
        child=serializers.DictField(child=serializers.JSONField()),
        help_text='per model (its Triton name), each setting to search: a list of values, or {"low", "high", '
        '"step"} for a number. Settings: ' + ", ".join(tuning.KNOBS),
    )
    trial_s = serializers.IntegerField(min_value=5, max_value=w.MAX_DURATION_S, help_text="load per trial, s")
    budget_s = serializers.IntegerField(min_value=60, max_value=24 * 3600, help_text="the whole run's bound, s")
    max_trials = serializers.IntegerField(min_value=1, max_value=tuning.MAX_TRIALS, required=False)
    seed = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)
    confirm = serializers.BooleanField(
        default=False, help_text="go ahead although live gateway keys use the mix's models (trials disturb them)"
    )


class TrialOut(serializers.ModelSerializer):
    class Meta:
        model = TuningTrial
        fields = ["number", "params", "plan", "status", "reason", "generation", "gpu_share", "figures", "goodput",
                  "started_at", "finished_at"]  # fmt: skip


class TuningOut(serializers.ModelSerializer):
    created_by = serializers.CharField(source="created_by.username", default=None)
    trials = TrialOut(many=True, read_only=True)
    result = serializers.SerializerMethodField(
        help_text="the best trial, the starting plan's (trial 0), the gain between them, and what the best plan changes"
    )

    class Meta:
        model = TuningRun
        fields = ["id", "deployment", "deployment_name", "spec", "start_generation", "start_plan", "status",
                  "status_message", "progress", "applied_generation", "created_by", "created_at", "started_at",
                  "finished_at", "trials", "result"]  # fmt: skip

    def get_result(self, run: TuningRun) -> dict[str, Any]:
        return selectors.tuning_result(run)


class TuningQuery(StrictSerializer):
    deployment = serializers.IntegerField(min_value=1, required=False)
    status = serializers.ChoiceField(choices=RunStatus.choices, required=False)


class TuningList(ListEndpoint):
    """GET: tuning runs, newest first (a cursor page). POST: start one on a
    ready deployment: 201 queued; 409 while a load test or another run is
    active there, or with code confirmation_required while live gateway keys
    use the mix's models (send confirm)."""

    permission_classes = [ReadOrOperate]
    serializer_class = TuningOut
    pagination_class = CursorPage
    query_class = TuningQuery
    ordering = "-id"

    def get_queryset(self) -> QuerySet[TuningRun]:
        return selectors.tuning_list().prefetch_related("trials")

    def filter_rows(self, rows: QuerySet[TuningRun], query: dict[str, Any]) -> QuerySet[TuningRun]:
        if query.get("deployment"):
            rows = rows.filter(deployment_id=query["deployment"])
        if query.get("status"):
            rows = rows.filter(status=query["status"])
        return rows

    @idempotent()
    @extend_schema(request=TuningIn, responses={201: TuningOut})
    def post(self, request: Request) -> Response:
        data = validated(TuningIn, request)
        deployment, confirm = data.pop("deployment"), data.pop("confirm")
        data["mix"] = [dict(entry, targets=dict(entry["targets"])) for entry in data["mix"]]
        run = services.tuning_create(deployment_id=deployment, spec=data, confirm=confirm, user=request.user)
        return Response(TuningOut(run).data, status=status.HTTP_201_CREATED)


class TuningDetail(APIView):
    """GET one run with its trials; DELETE a finished one."""

    permission_classes = [ReadOrOperate]

    @extend_schema(responses=TuningOut)
    def get(self, request: Request, pk: int) -> Response:
        return Response(TuningOut(selectors.tuning_get(pk)).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, pk: int) -> Response:
        services.tuning_delete(run_id=pk, user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class TuningCancel(APIView):
    """POST: stop the search; the deployment gets its starting settings back."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=None, responses={202: TuningOut})
    def post(self, request: Request, pk: int) -> Response:
        require_empty_body(request)
        run = services.tuning_cancel(run_id=pk, user=request.user)
        return Response(TuningOut(run).data, status=status.HTTP_202_ACCEPTED)


class ApplyIn(StrictSerializer):
    trial = serializers.IntegerField(min_value=0, required=False, help_text="a measured trial; the best if absent")


class TuningApply(APIView):
    """POST: make the best trial's plan (or a named one's) the deployment's next generation."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=ApplyIn, responses={202: TuningOut})
    def post(self, request: Request, pk: int) -> Response:
        data = validated(ApplyIn, request) if request.data else {}
        run = services.tuning_apply(run_id=pk, trial=data.get("trial"), user=request.user)
        return Response(TuningOut(run).data, status=status.HTTP_202_ACCEPTED)


class FileQuery(StrictSerializer):
    file = serializers.ChoiceField(choices=["csv", "json"], default="csv")


class TuningExport(APIView):
    """GET /api/tuning/<id>/export/?file=csv: one row per trial, as a file."""

    permission_classes = [ReadOrOperate]

    @extend_schema(
        parameters=[FileQuery],
        responses={200: OpenApiTypes.BINARY},
        description="text/csv or application/json, as an attachment",
    )
    def get(self, request: Request, pk: int) -> HttpResponse:
        query = checked_query(FileQuery, request.query_params)
        rows = selectors.tuning_rows(selectors.tuning_get(pk))
        if query["file"] == "json":
            response = HttpResponse(json.dumps(rows, indent=1), content_type="application/json")
        else:
            columns = list(dict.fromkeys(key for row in rows for key in row)) or ["run"]
            out = io.StringIO()
            writer = csv.DictWriter(out, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
            response = HttpResponse(out.getvalue(), content_type="text/csv")
        response["Content-Disposition"] = f'attachment; filename="tuning-{pk}.{query["file"]}"'
        return response
