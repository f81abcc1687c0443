"""/api/loadtests/: start, follow, cancel, compare and export load tests; /api/tuning/:
start, follow, cancel, apply and export tuning runs."""

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
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from access.idempotency import idempotent
from core.api.base import StrictSerializer, require_empty_body, validated
from core.api.lists import CursorPage, ListEndpoint, checked_query
from core.permissions import ReadOrOperate
from loadtests import selectors, services, tuning
from loadtests import tuning_services as tunings
from loadtests import workload as w
from loadtests.models import LoadPoint, LoadTest, RunStatus, TuningRun, TuningTrial


class ThresholdsIn(StrictSerializer):
    """Latency limits (ms) a request must meet to count towards goodput."""

    time_to_first_token_ms = serializers.FloatField(min_value=0.001, max_value=600_000, required=False)
    inter_token_latency_ms = serializers.FloatField(min_value=0.001, max_value=600_000, required=False)
    request_latency_ms = serializers.FloatField(min_value=0.001, max_value=3_600_000, required=False)


class WorkloadIn(StrictSerializer):
    """Types and ranges; the rules that need the model's kind are in loadtests.workload."""

    mode = serializers.ChoiceField(choices=w.MODES, required=False, help_text="a concurrency sweep, or request rates")
    levels = serializers.ListField(
        child=serializers.FloatField(min_value=0.001, max_value=w.MAX_RATE),
        min_length=1,
        max_length=w.MAX_LEVELS,
        required=False,
        help_text="concurrent requests (1-256), or requests per second, one step each",
    )
    duration_s = serializers.IntegerField(min_value=5, max_value=w.MAX_DURATION_S, required=False, allow_null=True)
    request_count = serializers.IntegerField(min_value=1, max_value=w.MAX_REQUESTS, required=False, allow_null=True)
    warmup_requests = serializers.IntegerField(min_value=0, max_value=100, required=False)
    endpoint = serializers.ChoiceField(choices=[*w.LLM_ENDPOINTS, "embedding", "reranker"], required=False)
    streaming = serializers.BooleanField(required=False)
    input_tokens = serializers.IntegerField(min_value=1, max_value=32_768, required=False)
    output_tokens = serializers.IntegerField(min_value=1, max_value=8192, required=False)
    batch_size = serializers.IntegerField(min_value=1, max_value=256, required=False)
    passages = serializers.IntegerField(min_value=1, max_value=100, required=False)
    thresholds = ThresholdsIn(required=False)
    direct = serializers.BooleanField(required=False, help_text="also run each level directly against Triton (LLMs)")
    native = serializers.BooleanField(
        required=False,
        help_text="also measure the engine's native ceiling with trtllm-bench at each level (a TensorRT-LLM "
        "engine on a host with TensorRT-LLM installed; needs mode concurrency and request_count)",
    )
    seed = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)
    dataset = serializers.ListField(
        child=serializers.CharField(max_length=w.MAX_DATASET_ENTRY_CHARS, trim_whitespace=False),
        min_length=1,
        max_length=w.MAX_DATASET_ENTRIES,
        required=False,
        help_text="your own prompts (LLM) or sentences (embedder), used in turn instead of synthetic ones",
    )


class LoadTestIn(StrictSerializer):
    deployment = serializers.IntegerField(min_value=1)
    model = serializers.CharField(max_length=128, help_text="the gateway alias to load (one of this deployment's)")
    workload = WorkloadIn(required=False, default=dict)
    confirm = serializers.BooleanField(
        default=False, help_text="go ahead although live gateway keys use this model (their requests will slow)"
    )


class PointOut(serializers.ModelSerializer):
    class Meta:
        model = LoadPoint
        fields = ["target", "level", "complete", "summary", "server", "started_at", "finished_at"]


class LoadTestOut(serializers.ModelSerializer):
    created_by = serializers.CharField(source="created_by.username", default=None)
    points = serializers.SerializerMethodField()
    ceiling = serializers.SerializerMethodField(
        help_text="served/native at each level with a native (trtllm-bench) step: output-token and request "
        "throughput, served, native and their ratio"
    )

    class Meta:
        model = LoadTest
        fields = [
            "id", "deployment", "deployment_name", "alias", "triton_name", "kind", "workload", "context", "status",
            "status_message", "progress", "log_tail", "created_by", "created_at", "started_at", "finished_at",
            "points", "ceiling",
        ]  # fmt: skip

    def _points(self, run: LoadTest) -> list[LoadPoint]:
        known = self.context.setdefault("points", {})
        if run.pk not in known:
            known.update(selectors.points_of([run.pk]))
        return known[run.pk]

    def get_points(self, run: LoadTest) -> list[dict[str, Any]]:
        return PointOut(self._points(run), many=True).data

    def get_ceiling(self, run: LoadTest) -> list[dict[str, Any]]:
        return selectors.ceiling(self._points(run))


class LoadTestQuery(StrictSerializer):
    deployment = serializers.IntegerField(min_value=1, required=False)
    status = serializers.ChoiceField(choices=RunStatus.choices, required=False)
    alias = serializers.CharField(max_length=128, required=False)


class LoadTestList(ListEndpoint):
    """GET: load tests, newest first (a cursor page). POST: start one on a ready
    deployment: 201 queued; 409 while another runs there, or with code
    confirmation_required while live gateway keys use the model (send confirm)."""

    permission_classes = [ReadOrOperate]
    serializer_class = LoadTestOut
    pagination_class = CursorPage
    query_class = LoadTestQuery
    ordering = "-id"

    def get_queryset(self) -> QuerySet[LoadTest]:
        return selectors.run_list()

    def filter_rows(self, rows: QuerySet[LoadTest], query: dict[str, Any]) -> QuerySet[LoadTest]:
        return selectors.run_filter(rows, **query)

    def page_context(self, page: list[LoadTest]) -> dict[str, Any]:
        return {"points": selectors.points_of([run.pk for run in page])}

    @idempotent()
    @extend_schema(request=LoadTestIn, responses={201: LoadTestOut})
    def post(self, request: Request) -> Response:
        data = validated(LoadTestIn, request)
        run = services.run_create(
            deployment_id=data["deployment"],
            alias=data["model"],
            spec=dict(data["workload"]),  # only the fields sent: the rest take the defaults of the model's kind
            confirm=data["confirm"],
            user=request.user,
        )
        return Response(LoadTestOut(run).data, status=status.HTTP_201_CREATED)


class LoadTestDetail(APIView):
    """GET one run with its steps' figures; DELETE a finished one."""

    permission_classes = [ReadOrOperate]

    @extend_schema(responses=LoadTestOut)
    def get(self, request: Request, pk: int) -> Response:
        return Response(LoadTestOut(selectors.run_get(pk)).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, pk: int) -> Response:
        services.run_delete(run_id=pk, user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class LoadTestCancel(APIView):
    permission_classes = [ReadOrOperate]

    @extend_schema(request=None, responses={202: LoadTestOut})
    def post(self, request: Request, pk: int) -> Response:
        require_empty_body(request)
        selectors.run_get(pk)
        run = services.run_cancel(run_id=pk, user=request.user)
        return Response(LoadTestOut(run).data, status=status.HTTP_202_ACCEPTED)


class RecordsQuery(StrictSerializer):
    target = serializers.ChoiceField(choices=LoadPoint.Target.choices, default="gateway")
    level = serializers.FloatField()


class LoadTestRecords(APIView):
    """GET /api/loadtests/<id>/records/?level=&target=: one step's per-request
    records (start offset, latency, first token, inter-token, tokens, error)."""

    permission_classes = [ReadOrOperate]

    @extend_schema(parameters=[RecordsQuery], responses={200: OpenApiTypes.OBJECT})
    def get(self, request: Request, pk: int) -> Response:
        query = checked_query(RecordsQuery, request.query_params)
        selectors.run_get(pk)
        point = LoadPoint.objects.filter(run_id=pk, target=query["target"], level=query["level"]).first()
        if point is None:
            raise ValidationError({"level": [f"load test {pk} has no {query['target']} step at {query['level']:g}"]})
        return Response({"target": point.target, "level": point.level, "records": point.records})


class CompareQuery(StrictSerializer):
    ids = serializers.CharField(help_text="load test ids, comma-separated (2 to 8)")


class ExportQuery(StrictSerializer):
    ids = serializers.CharField(help_text="load test ids, comma-separated (1 to 8)")
    file = serializers.ChoiceField(choices=["csv", "json"], default="csv")


class LoadTestCompare(APIView):
    """GET /api/loadtests/compare/?ids=3,5: the runs side by side (each step's
    throughput and latency percentiles) and every setting that differs."""

    permission_classes = [ReadOrOperate]

    @extend_schema(parameters=[CompareQuery], responses={200: OpenApiTypes.OBJECT})
    def get(self, request: Request) -> Response:
        return Response(
            selectors.comparison(selectors.ids_in(checked_query(CompareQuery, request.query_params)["ids"]))
        )


class LoadTestExport(APIView):
    """GET /api/loadtests/export/?ids=3,5&file=csv: one row per step, as a file."""

    permission_classes = [ReadOrOperate]

    @extend_schema(
        parameters=[ExportQuery],
        responses={200: OpenApiTypes.BINARY},
        description="text/csv or application/json, as an attachment",
    )
    def get(self, request: Request) -> HttpResponse:
        query = checked_query(ExportQuery, request.query_params)
        ids = selectors.ids_in(query["ids"])
        rows = selectors.export_rows(ids)
        name = "loadtests-" + "-".join(str(i) for i in ids)
        if query["file"] == "json":
            response = HttpResponse(json.dumps(rows, indent=1), content_type="application/json")
        else:
            out = io.StringIO()
            writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else ["run"])
            writer.writeheader()
            writer.writerows(rows)
            response = HttpResponse(out.getvalue(), content_type="text/csv")
        response["Content-Disposition"] = f'attachment; filename="{name}.{query["file"]}"'
        return response


# --- tuning runs -------------------------------------------------------------------


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
    end_on = serializers.ChoiceField(
        choices=tuning.END_ON,
        default=tuning.END_ON_START,
        help_text="what a finished run leaves the deployment on: 'start' (its starting settings; apply a plan "
        "later) or 'best' (the best trial's plan where it met every target, in one roll-out; else the start)",
    )
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
                  "status_message", "progress", "applied_generation", "restore_pending", "created_by", "created_at",
                  "started_at",
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
        run = tunings.tuning_create(deployment_id=deployment, spec=data, confirm=confirm, user=request.user)
        return Response(TuningOut(run).data, status=status.HTTP_201_CREATED)


class TuningDetail(APIView):
    """GET one run with its trials; DELETE a finished one."""

    permission_classes = [ReadOrOperate]

    @extend_schema(responses=TuningOut)
    def get(self, request: Request, pk: int) -> Response:
        return Response(TuningOut(selectors.tuning_get(pk)).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, pk: int) -> Response:
        tunings.tuning_delete(run_id=pk, user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class TuningCancel(APIView):
    """POST: stop the search; the deployment gets its starting settings back."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=None, responses={202: TuningOut})
    def post(self, request: Request, pk: int) -> Response:
        require_empty_body(request)
        run = tunings.tuning_cancel(run_id=pk, user=request.user)
        return Response(TuningOut(run).data, status=status.HTTP_202_ACCEPTED)


class ApplyIn(StrictSerializer):
    trial = serializers.IntegerField(min_value=0, required=False, help_text="a measured trial; the best if absent")


class TuningApply(APIView):
    """POST: make the best trial's plan (or a named one's) the deployment's next generation."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=ApplyIn, responses={202: TuningOut})
    def post(self, request: Request, pk: int) -> Response:
        data = validated(ApplyIn, request) if request.data else {}
        run = tunings.tuning_apply(run_id=pk, trial=data.get("trial"), user=request.user)
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
