"""/api/tokens/: personal API tokens. Everyone manages their own; an admin
sees and revokes everyone's."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.generics import get_object_or_404
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from access import services
from access.idempotency import idempotent
from access.models import ApiToken
from core.api.base import StrictSerializer, require_empty_body, validated
from core.api.lists import ListEndpoint
from core.permissions import CanView, can_admin


class TokenOut(serializers.ModelSerializer):
    user = serializers.CharField(source="user.username")
    state = serializers.ChoiceField(choices=["active", "expired", "revoked"])

    class Meta:
        model = ApiToken
        fields = ["id", "name", "prefix", "user", "state", "created_at", "expires_at", "last_used_at", "revoked_at"]


class NewTokenOut(TokenOut):
    token = serializers.CharField(help_text="the secret: shown this once, stored only as a digest")

    class Meta(TokenOut.Meta):
        fields = [*TokenOut.Meta.fields, "token"]


class TokenIn(StrictSerializer):
    name = serializers.CharField(max_length=100)
    expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None, help_text="empty: never")


class TokenQuery(StrictSerializer):
    user = serializers.CharField(max_length=150, required=False, help_text="admins: someone else's tokens")
    state = serializers.ChoiceField(choices=["active", "revoked"], required=False)


def visible_tokens(user: Any) -> QuerySet[ApiToken]:
    rows = ApiToken.objects.select_related("user")
    return rows if can_admin(user) else rows.filter(user=user)


class TokenList(ListEndpoint):
    """GET: your tokens, newest first (an admin: everyone's, ``?user=``); POST: a
    new token; the answer's ``token`` is the secret, shown this once."""

    permission_classes = [CanView]
    serializer_class = TokenOut
    query_class = TokenQuery
    ordering_fields = ("created_at", "name", "last_used_at")
    ordering = "-created_at"

    def get_queryset(self) -> QuerySet[ApiToken]:
        return visible_tokens(self.request.user)

    def filter_rows(self, rows: QuerySet[ApiToken], query: dict[str, Any]) -> QuerySet[ApiToken]:
        if "user" in query:
            rows = rows.filter(user__username=query["user"])
        if "state" in query:
            rows = rows.filter(revoked_at__isnull=query["state"] == "active")
        return rows

    @idempotent(redact=("token",))
    @extend_schema(request=TokenIn, responses={201: NewTokenOut})
    def post(self, request: Request) -> Response:
        data = validated(TokenIn, request)
        created = services.token_create(user=request.user, name=data["name"], expires_at=data["expires_at"])
        created.token.token = created.secret  # serialized this once, never stored
        return Response(NewTokenOut(created.token).data, status=status.HTTP_201_CREATED)


class TokenDetail(APIView):
    permission_classes = [CanView]

    @extend_schema(responses=TokenOut)
    def get(self, request: Request, pk: int) -> Response:
        return Response(TokenOut(get_object_or_404(visible_tokens(request.user), pk=pk)).data)


class TokenRevoke(APIView):
    """POST (no body): the token stops working at once; it stays listed."""

    permission_classes = [CanView]

    @extend_schema(request=None, responses=TokenOut)
    def post(self, request: Request, pk: int) -> Response:
        require_empty_body(request)
        token = services.token_revoke(token_id=pk, user=request.user)
        return Response(TokenOut(token).data, status=status.HTTP_200_OK)
