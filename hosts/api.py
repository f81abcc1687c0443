"""GET /api/hosts/ and /api/hosts/<name>/: GPU hosts and their GPUs; joining hosts
and revoking them; cordoning and draining them."""

from __future__ import annotations

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.generics import get_object_or_404
from rest_framework.permissions import AllowAny, BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api.base import StrictSerializer, require_empty_body, validated
from core.api.lists import ListEndpoint
from core.permissions import ReadOrOperate, can_admin
from deployments.services import replicas
from hosts import selectors
from hosts.models import Gpu, GpuHost
from hosts.services import host_join, hosts


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
    cordoned = serializers.BooleanField(read_only=True, help_text="no replica is placed on it (an admin cordoned it)")
    queue = serializers.CharField(read_only=True, help_text="The control queue: launch, stop, apply, inspect.")
    jobs_queue = serializers.CharField(read_only=True, help_text="The jobs queue: engine builds and load tests.")

    class Meta:
        model = GpuHost
        fields = [
            "name",
            "address",
            "is_online",
            "cordoned",
            "last_heartbeat",
            "driver_version",
            "cuda_version",
            "nvml_error",
            "agent_version",
            "channel_port",
            "channel_revoked",
            "queue",
            "jobs_queue",
            "gpus",
        ]


class HostList(ListEndpoint):
    """GET /api/hosts/: every GPU host that has announced itself, by name."""

    permission_classes = [ReadOrOperate]
    serializer_class = HostOut
    ordering_fields = ("name", "last_heartbeat")
    ordering = "name"

    def get_queryset(self) -> QuerySet[GpuHost]:
        return selectors.host_list()


class HostDetail(APIView):
    permission_classes = [ReadOrOperate]

    @extend_schema(responses=HostOut)
    def get(self, request: Request, name: str) -> Response:
        return Response(HostOut(get_object_or_404(selectors.host_list(), name=name)).data)


class Admins(BasePermission):
    message = host_join.ADMIN_REQUIRED

    def has_permission(self, request, view) -> bool:  # noqa: ANN001
        return can_admin(request.user)


class JoinTokenIn(StrictSerializer):
    host = serializers.CharField(
        required=False, allow_blank=True, max_length=63, help_text="The host it is for; empty or absent: any name."
    )
    expires_in_minutes = serializers.IntegerField(
        required=False, default=60, min_value=1, max_value=host_join.JOIN_TOKEN_MINUTES_MAX
    )


class JoinTokenOut(serializers.Serializer):
    token = serializers.CharField(help_text="Shown once: only its hash is kept.")
    host = serializers.CharField()
    expires_at = serializers.DateTimeField()
    command = serializers.CharField(help_text="What to run on the GPU host.")


class HostJoinTokens(APIView):
    """POST /api/hosts/join-tokens/: a one-time token with which a GPU host joins (admins)."""

    permission_classes = [Admins]

    @extend_schema(request=JoinTokenIn, responses={201: JoinTokenOut})
    def post(self, request: Request) -> Response:
        body = validated(JoinTokenIn, request)
        made = host_join.host_join_token_create(
            user=request.user, host_name=body.get("host", ""), minutes=body["expires_in_minutes"]
        )
        base = request.build_absolute_uri("/").rstrip("/")
        out = {
            "token": made.secret,
            "host": made.row.host_name,
            "expires_at": made.row.expires_at,
            "command": join_command(base, made.secret, made.row.host_name),
        }
        return Response(JoinTokenOut(out).data, status=201)


def join_command(base: str, secret: str, host_name: str) -> str:
    """The command line a GPU host joins with."""
    return f"gantry join {base} {secret}" + (f" --name {host_name}" if host_name else "")


class JoinIn(StrictSerializer):
    token = serializers.CharField(max_length=128)
    name = serializers.CharField(max_length=63, help_text="The host's name; its queues are gpu.<name>.")
    address = serializers.CharField(
        required=False, allow_blank=True, max_length=255, help_text="Where the web tier reaches its channel."
    )
    certificate_request = serializers.CharField(
        required=False, allow_blank=True, max_length=8000,
        help_text="A PEM certificate request for its channel key (P-256): signed in the same step.",
    )  # fmt: skip


class JoinedOut(serializers.Serializer):
    host = serializers.CharField()
    database_url = serializers.CharField(help_text="PostgreSQL with the host's own role.")
    redis_url = serializers.CharField(help_text="Redis with the host's own ACL user.")
    settings = serializers.DictField(child=serializers.CharField(allow_blank=True))
    certificate = serializers.CharField(help_text="Its channel certificate (PEM); empty without a request.")
    trust = serializers.CharField(help_text="The channel authority's certificate and revocation list (PEM).")


class HostJoin(APIView):
    """POST /api/hosts/join/: a GPU host trades its join token for its own credentials.
    The token is the authentication: no session, no personal token."""

    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(request=JoinIn, responses={201: JoinedOut}, auth=[])
    def post(self, request: Request) -> Response:
        body = validated(JoinIn, request)
        joined = host_join.host_join(
            token=body["token"],
            name=body["name"],
            address=body.get("address", ""),
            gateway_url=request.build_absolute_uri("/").rstrip("/"),
            certificate_request=body.get("certificate_request", ""),
        )
        out = {
            "host": joined.host.name,
            "database_url": joined.database_url,
            "redis_url": joined.redis_url,
            "settings": joined.settings,
            "certificate": joined.certificate,
            "trust": joined.trust,
        }
        return Response(JoinedOut(out).data, status=201)


class RevokedOut(serializers.Serializer):
    revoked = serializers.IntegerField(help_text="Credentials and channel certificates revoked (0: it had none).")


class HostRevoke(APIView):
    """POST /api/hosts/<name>/revoke/: the host's database role and Redis user are
    removed and its connections closed, and its channel certificates are revoked
    (admins). It joins again with a new token."""

    permission_classes = [Admins]

    @extend_schema(request=None, responses=RevokedOut)
    def post(self, request: Request, name: str) -> Response:
        require_empty_body(request)
        return Response({"revoked": host_join.host_credentials_revoke(user=request.user, host_name=name)})


class CordonIn(StrictSerializer):
    reason = serializers.CharField(max_length=255, required=False, default="", allow_blank=True)


class HostCordon(APIView):
    """POST /api/hosts/<name>/cordon/ {"reason"?}: no replica is placed on the host
    any more; those it runs stay (admins). /uncordon/ (no body) lifts it."""

    permission_classes = [Admins]
    cordoned = True

    @extend_schema(request=CordonIn, responses=HostOut)
    def post(self, request: Request, name: str) -> Response:
        reason = ""
        if self.cordoned:
            reason = validated(CordonIn, request)["reason"]
        else:
            require_empty_body(request)
        hosts.host_cordon(host_name=name, user=request.user, cordoned=self.cordoned, reason=reason)
        return Response(HostOut(selectors.host_list().get(name=name)).data)


class HostUncordon(HostCordon):
    cordoned = False

    @extend_schema(request=None, responses=HostOut)
    def post(self, request: Request, name: str) -> Response:
        return super().post(request, name)


class DrainedOut(serializers.Serializer):
    host = HostOut()
    replicas = serializers.ListField(child=serializers.CharField(), help_text="what happened to each replica")


class HostDrain(APIView):
    """POST /api/hosts/<name>/drain/ (no body): cordon the host and move its
    replicas to other hosts, each one's replacement ready before it is retired
    (and drained of its requests); one with no room elsewhere stays (admins)."""

    permission_classes = [Admins]

    @extend_schema(request=None, responses={202: DrainedOut})
    def post(self, request: Request, name: str) -> Response:
        require_empty_body(request)
        said = replicas.host_drain(host_name=name, user=request.user)
        host = HostOut(selectors.host_list().get(name=name)).data
        return Response({"host": host, "replicas": said}, status=status.HTTP_202_ACCEPTED)
