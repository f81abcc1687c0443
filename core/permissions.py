"""Roles, one set of rules for every door (pages, REST API, websockets, admin).

- viewer: any active signed-in user. Reads everything, queries deployed
  models (the playgrounds), and manages their own personal tokens.
- operator: a member of the group OPERATOR_GROUP (or an admin). Also
  registers, builds, deploys, starts, stops, changes, rolls back and deletes,
  and manages gateway aliases and keys.
- admin: a superuser, or a member of ADMIN_GROUP. Also the Django admin, and
  everyone's personal tokens.
"""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import SAFE_METHODS, BasePermission

from common.errors import PermissionDenied

OPERATOR_GROUP = "gantry-operators"
ADMIN_GROUP = "gantry-admins"
OPERATOR_REQUIRED = "this needs the operator role (group 'gantry-operators') or an admin"


def can_view(user: Any) -> bool:
    return bool(user and user.is_authenticated and user.is_active)


def _in_group(user: Any, name: str) -> bool:
    # Groups are read once per request object: a page checks roles many times.
    names = getattr(user, "_gantry_groups", None)
    if names is None:
        names = set(user.groups.values_list("name", flat=True))
        user._gantry_groups = names
    return name in names


def can_admin(user: Any) -> bool:
    return can_view(user) and (user.is_superuser or _in_group(user, ADMIN_GROUP))


def can_operate(user: Any) -> bool:
    return can_view(user) and (can_admin(user) or _in_group(user, OPERATOR_GROUP))


def role_of(user: Any) -> str:
    """The highest role of ``user``: admin, operator, viewer, or anonymous."""
    if can_admin(user):
        return "admin"
    if can_operate(user):
        return "operator"
    return "viewer" if can_view(user) else "anonymous"


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
