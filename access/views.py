"""The tokens page: make a personal API token (its secret shown once), see
when each was last used, revoke it."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone

from access import oidc, services, throttles
from access.api import visible_tokens
from common.errors import GantryError
from deployments.web.forms import show_refusal

_NEW_SECRET = "access-new-token"
LIFETIMES = [("30", "30 days"), ("90", "90 days"), ("365", "a year"), ("", "never expires")]


class TokenForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="what it is for, e.g. 'CI deploys'")
    lifetime = forms.ChoiceField(choices=LIFETIMES, initial="90", required=False, label="Expires after")


@login_required
def tokens_page(request: HttpRequest) -> HttpResponse:
    action = request.POST.get("action") if request.method == "POST" else None
    form = TokenForm(request.POST if action == "create" else None)
    new_secret = request.session.pop(_NEW_SECRET, None) if request.method == "GET" else None
    try:
        if action == "create" and form.is_valid():
            days = form.cleaned_data["lifetime"]
            expires_at = timezone.now() + dt.timedelta(days=int(days)) if days else None
            created = services.token_create(user=request.user, name=form.cleaned_data["name"], expires_at=expires_at)
            # Post/redirect/get: a reload cannot make a second token; the secret
            # waits in the server-side session and is removed when shown.
            request.session[_NEW_SECRET] = created.secret
            return redirect("tokens")
        if action == "revoke":
            token = services.token_revoke(token_id=int(request.POST.get("token") or 0), user=request.user)
            messages.success(request, f"Token {token.name} revoked: it no longer works.")
            return redirect("tokens")
    except GantryError as exc:
        if action == "create":
            show_refusal(form, exc)
        else:
            messages.error(request, str(exc))
    return render(
        request,
        "access/tokens.html",
        {"tokens": visible_tokens(request.user)[:500], "form": form, "new_secret": new_secret},
    )


class LoginView(auth_views.LoginView):
    """Django's sign-in form, refusing for a while after GANTRY_LOGIN_ATTEMPTS
    failures for one account, or GANTRY_LOGIN_ADDRESS_ATTEMPTS from one
    address (429 with Retry-After, said in words). A refused sign-in checks no
    password: it answers the same whatever was sent."""

    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        username, address = request.POST.get("username", ""), request.META.get("REMOTE_ADDR", "")
        left = throttles.login_locked_for(username, address)
        if left:
            # An unbound form: nothing is validated, so nothing authenticates.
            form = self.get_form_class()(request=request, initial={"username": username})
            refused = f"Too many failed sign-ins: try again in {math.ceil(left / 60)} minutes."
            response = self.render_to_response(self.get_context_data(form=form, refused=refused), status=429)
            response["Retry-After"] = str(left)
            return response
        return super().post(request, *args, **kwargs)

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["sso_name"] = settings.GANTRY_OIDC_NAME if oidc.enabled() else ""
        context.setdefault("refused", self.request.session.pop(oidc.REFUSAL, ""))
        return context

    def form_invalid(self, form: Any) -> HttpResponse:
        throttles.login_failed(self.request.POST.get("username", ""), self.request.META.get("REMOTE_ADDR", ""))
        return super().form_invalid(form)

    def form_valid(self, form: Any) -> HttpResponse:
        throttles.login_succeeded(form.get_user().get_username(), self.request.META.get("REMOTE_ADDR", ""))
        return super().form_valid(form)
