"""The Django admin admits the admin role only (core.permissions):
superusers and members of the group 'gantry-admins', whatever their is_staff."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib import admin
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.urls import reverse

from core.permissions import can_admin


class _AdminLogin(AdminAuthenticationForm):
    def confirm_login_allowed(self, user: Any) -> None:
        if not can_admin(user):
            raise ValidationError("The admin is for the admin role (group 'gantry-admins').", code="invalid_login")


class GantryAdminSite(admin.AdminSite):
    site_header = "Gantry admin"
    site_title = "Gantry admin"
    login_form = _AdminLogin

    def has_permission(self, request: HttpRequest) -> bool:
        return can_admin(request.user)

    def login(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # One sign-in form for the whole site, with its lockout (access.views.LoginView).
        return redirect_to_login(request.GET.get("next") or reverse("admin:index"), settings.LOGIN_URL)


class AdminGroupBackend:
    """An authentication backend that authenticates no one and gives members
    of 'gantry-admins' every model permission, as superusers have, so the
    admin's per-model checks follow the role."""

    def authenticate(self, request: HttpRequest | None, **credentials: Any) -> None:
        return None

    def has_perm(self, user: Any, perm: str, obj: Any = None) -> bool:
        return can_admin(user)

    def has_module_perms(self, user: Any, app_label: str) -> bool:
        return can_admin(user)
