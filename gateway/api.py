"""/api/gateway/: the gateway's aliases, keys and usage, for automation (the
browser's gateway page uses the same services)."""

from __future__ import annotations

from typing import Any

from django.db.models import Count, QuerySet, Sum
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
from gateway import services
from gateway.models import Alias, ApiKey, Usage, alias_validator


class AliasOut(serializers.ModelSerializer):
    deployment_name = serializers.CharField(source="deployment.name")
    deployment_status = serializers.CharField(source="deployment.status")
    model = serializers.CharField(source="triton_name")

    class Meta:
        model = Alias
        fields = [
            "id",
            "name",
            "deployment",
            "deployment_name",
            "deployment_status",
            "model",
            "created_at",
            "updated_at",
        ]


class AliasIn(StrictSerializer):
    name = serializers.CharField(max_length=128, validators=[alias_validator])
    deployment = serializers.IntegerField(min_value=1)
    model = serializers.CharField(max_length=63, help_text="the model's name in the deployment (its Triton name)")


class AliasMoveIn(StrictSerializer):
    deployment = serializers.IntegerField(min_value=1)
    model = serializers.CharField(max_length=63)


def _aliases() -> QuerySet[Alias]:
    return Alias.objects.select_related("deployment")


class AliasQuery(StrictSerializer):
    deployment = serializers.IntegerField(min_value=1, required=False)


class AliasList(ListEndpoint):
    """GET: the aliases, by name. POST {name, deployment, model}: point a new
    gateway model name at a deployment's model."""

    permission_classes = [ReadOrOperate]
    serializer_class = AliasOut
    query_class = AliasQuery
    ordering_fields = ("name", "updated_at")
    ordering = "name"

    def get_queryset(self) -> QuerySet[Alias]:
        return _aliases()

    def filter_rows(self, rows: QuerySet[Alias], query: dict[str, Any]) -> QuerySet[Alias]:
        return rows.filter(deployment_id=query["deployment"]) if "deployment" in query else rows

    @idempotent()
    @extend_schema(request=AliasIn, responses={201: AliasOut})
    def post(self, request: Request) -> Response:
        data = validated(AliasIn, request)
        alias = services.alias_create(
            name=data["name"], deployment_id=data["deployment"], triton_name=data["model"], user=request.user
        )
        return Response(AliasOut(_aliases().get(pk=alias.pk)).data, status=status.HTTP_201_CREATED)


class AliasDetail(APIView):
    """GET; PATCH {deployment, model}: move the alias (atomic, on the timeline); DELETE."""

    permission_classes = [ReadOrOperate]

    @extend_schema(responses=AliasOut)
    def get(self, request: Request, pk: int) -> Response:
        return Response(AliasOut(get_object_or_404(_aliases(), pk=pk)).data)

    @extend_schema(request=AliasMoveIn, responses=AliasOut)
    def patch(self, request: Request, pk: int) -> Response:
        data = validated(AliasMoveIn, request)
        services.alias_move(alias_id=pk, deployment_id=data["deployment"], triton_name=data["model"], user=request.user)
        return Response(AliasOut(_aliases().get(pk=pk)).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, pk: int) -> Response:
        services.alias_delete(alias_id=pk, user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class KeyOut(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username")
    aliases = serializers.SerializerMethodField()
    state = serializers.CharField()
    usage = serializers.SerializerMethodField(help_text="all-time totals")

    class Meta:
        model = ApiKey
        fields = [
            "id", "name", "prefix", "owner", "state", "all_aliases", "aliases", "expires_at",
            "requests_per_minute", "tokens_per_minute", "revoked_at", "last_used_at", "created_at", "usage",
        ]  # fmt: skip

    def get_aliases(self, key: ApiKey) -> list[str]:
        return sorted(a.name for a in key.aliases.all())

    def get_usage(self, key: ApiKey) -> dict[str, int]:
        return {
            "requests": key.total_requests or 0,
            "failed": key.total_failed or 0,
            "prompt_tokens": key.total_prompt_tokens or 0,
            "completion_tokens": key.total_completion_tokens or 0,
        }


class NewKeyOut(KeyOut):
    key = serializers.CharField(help_text="the secret: shown this once, stored only as a digest")

    class Meta(KeyOut.Meta):
        fields = [*KeyOut.Meta.fields, "key"]


def keys_with_usage() -> QuerySet[ApiKey]:
    """Keys with their owner, aliases and usage totals, in three queries whatever their number."""
    return (
        ApiKey.objects.select_related("owner")
        .prefetch_related("aliases")
        .annotate(
            total_requests=Sum("usage__requests"),
            total_failed=Sum("usage__failed"),
            total_prompt_tokens=Sum("usage__prompt_tokens"),
            total_completion_tokens=Sum("usage__completion_tokens"),
        )
    )


class KeyIn(StrictSerializer):
    name = serializers.CharField(max_length=100)
    all_aliases = serializers.BooleanField(default=False)
    aliases = serializers.ListField(child=serializers.CharField(max_length=128), max_length=1000, default=list)
    expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None)
    requests_per_minute = serializers.IntegerField(min_value=1, max_value=10_000_000, required=False, allow_null=True)
    tokens_per_minute = serializers.IntegerField(min_value=1, max_value=2_000_000_000, required=False, allow_null=True)


class KeyQuery(StrictSerializer):
    owner = serializers.CharField(max_length=150, required=False)
    revoked = serializers.BooleanField(required=False)


class KeyList(ListEndpoint):
    """GET: the keys, newest first (never their secrets). POST: a new key; the
    answer's ``key`` is the secret, shown this once."""

    permission_classes = [ReadOrOperate]
    serializer_class = KeyOut
    query_class = KeyQuery
    ordering_fields = ("created_at", "name", "last_used_at")
    ordering = "-created_at"

    def get_queryset(self) -> QuerySet[ApiKey]:
        return keys_with_usage()

    def filter_rows(self, rows: QuerySet[ApiKey], query: dict[str, Any]) -> QuerySet[ApiKey]:
        if "owner" in query:
            rows = rows.filter(owner__username=query["owner"])
        if "revoked" in query:
            rows = rows.filter(revoked_at__isnull=not query["revoked"])
        return rows

    @idempotent(redact=("key",))
    @extend_schema(request=KeyIn, responses={201: NewKeyOut})
    def post(self, request: Request) -> Response:
        data = validated(KeyIn, request)
        created = services.key_create(
            name=data["name"],
            user=request.user,
            all_aliases=data["all_aliases"],
            alias_names=data["aliases"],
            expires_at=data["expires_at"],
            requests_per_minute=data.get("requests_per_minute"),
            tokens_per_minute=data.get("tokens_per_minute"),
        )
        body = {**KeyOut(keys_with_usage().get(pk=created.key.pk)).data, "key": created.secret}
        return Response(body, status=status.HTTP_201_CREATED)


class KeyDetail(APIView):
    permission_classes = [ReadOrOperate]

    @extend_schema(responses=KeyOut)
    def get(self, request: Request, pk: int) -> Response:
        return Response(KeyOut(get_object_or_404(keys_with_usage(), pk=pk)).data)


class KeyRevoke(APIView):
    """POST: the key stops working (within a second); it stays listed, with its usage."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=None, responses=KeyOut)
    def post(self, request: Request, pk: int) -> Response:
        require_empty_body(request)
        services.key_revoke(key_id=pk, user=request.user)
        return Response(KeyOut(keys_with_usage().get(pk=pk)).data)


class UsageOut(serializers.ModelSerializer):
    key_name = serializers.CharField(source="key.name")

    class Meta:
        model = Usage
        fields = ["key", "key_name", "alias", "day", "requests", "failed", "prompt_tokens", "completion_tokens"]


class UsageQuery(StrictSerializer):
    key = serializers.IntegerField(min_value=1, required=False)
    alias = serializers.CharField(max_length=128, required=False)
    since = serializers.DateField(required=False)


class UsageList(ListEndpoint):
    """GET ?key=&alias=&since=YYYY-MM-DD: usage per key, alias and day, newest
    first, with the totals of every matching row (not only this page's)."""

    permission_classes = [ReadOrOperate]
    serializer_class = UsageOut
    query_class = UsageQuery
    ordering_fields = ("day", "requests")
    ordering = "-day"

    def get_queryset(self) -> QuerySet[Usage]:
        return Usage.objects.select_related("key")

    def filter_rows(self, rows: QuerySet[Usage], query: dict[str, Any]) -> QuerySet[Usage]:
        lookups = {"key": "key_id", "alias": "alias", "since": "day__gte"}
        return rows.filter(**{lookups[k]: v for k, v in query.items()})

    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        response = super().get(request, *args, **kwargs)
        totals = self.matching.aggregate(
            requests=Sum("requests"), failed=Sum("failed"), prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"), rows=Count("id"),
        )  # fmt: skip
        response.data["totals"] = {k: v or 0 for k, v in totals.items()}
        return response
