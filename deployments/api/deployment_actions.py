"""The actions on a deployment: start, restart, roll back to a generation,
scale, autoscale and stop; each answers with the deployment as its service
left it (202: the hosts act on it next)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api.base import StrictSerializer, require_empty_body, validated
from core.permissions import ReadOrOperate
from deployments import selectors
from deployments.api.deployments import AutoscaleIn, DeploymentOut, autoscale_spec
from deployments.services import deployments as deployment_services
from deployments.services.autoscale import deployment_autoscale_set


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


class StopIn(StrictSerializer):
    now = serializers.BooleanField(
        default=False,
        help_text="stop every server at once, cutting what it holds; false (or no body): each replica leaves "
        "balancing and answers its requests in flight first, for up to the deployment's drain_timeout_s",
    )


class DeploymentStop(APIView):
    """POST /api/deployments/<id>/stop/ (no body, or {"now": true}): every
    replica's host stops its server, after draining it unless ``now``."""

    permission_classes = [ReadOrOperate]

    @extend_schema(request=StopIn, responses={202: DeploymentOut})
    def post(self, request: Request, pk: int) -> Response:
        data = validated(StopIn, request)
        deployment = deployment_services.deployment_stop(deployment_id=pk, user=request.user, now=data["now"])
        return Response(DeploymentOut(selectors.deployment_shown(deployment)).data, status=status.HTTP_202_ACCEPTED)
