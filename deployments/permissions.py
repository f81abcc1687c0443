"""Roles. Any active signed-in user may look; operators and admins may act.

An operator is a member of the group named by OPERATOR_GROUP, or a superuser.
"""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import SAFE_METHODS, BasePermission

from deployments.errors import PermissionDenied

OPERATOR_GROUP = "gantry-operators"
OPERATOR_REQUIRED = "this needs the operator role (group 'gantry-operators') or an admin"


def can_view(user: Any) -> bool:
    return bool(user and user.is_authenticated and user.is_active)


def can_operate(user: Any) -> bool:
    if not can_view(user):
        return False
    return user.is_superuser or user.groups.filter(name=OPERATOR_GROUP).exists()


def user_for_token(key: str) -> Any:
    """The active user an API token belongs to, or None (the REST API's, websockets'
    and the generate action's ``Authorization: Token`` header)."""
    from rest_framework.authtoken.models import Token

    token = Token.objects.select_related("user").filter(key=key).first()
    return token.user if token is not None and token.user.is_active else None


def require_operator(user: Any) -> None:
    """For services: refuse a signed-in user who may not act (None is the system itself)."""
    if user is not None and not can_operate(user):
        raise PermissionDenied(OPERATOR_REQUIRED)


class ReadOrOperate(BasePermission):
    """Reads for every signed-in user, writes for operators."""

    message = OPERATOR_REQUIRED

    def has_permission(self, request, view) -> bool:  # noqa: ANN001
        if request.method in SAFE_METHODS:
            return can_view(request.user)
        return can_operate(request.user)


class CanView(BasePermission):
    """Any signed-in active user, whatever the method."""

    def has_permission(self, request, view) -> bool:  # noqa: ANN001
        return can_view(request.user)
