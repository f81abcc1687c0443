"""Every page knows the signed-in user's role (deployments.permissions)."""

from __future__ import annotations

from django.http import HttpRequest

from deployments.permissions import role_of


def role(request: HttpRequest) -> dict[str, str]:
    return {"role": role_of(getattr(request, "user", None))}
