"""Every page knows the signed-in user's role (core.permissions)."""

from __future__ import annotations

from django.http import HttpRequest

from core.permissions import role_of


def role(request: HttpRequest) -> dict[str, str]:
    return {"role": role_of(getattr(request, "user", None))}
