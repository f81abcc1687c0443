"""The gateway page: aliases, keys (a new key's secret shown once) and usage."""

from __future__ import annotations

import datetime as dt

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone

from common.errors import GantryError
from core.permissions import can_operate
from deployments.models import DeploymentModel
from deployments.web.forms import show_refusal
from gateway import services
from gateway.api import keys_with_usage
from gateway.models import Alias, Usage, alias_validator

USAGE_DAYS = 30
_NEW_SECRET = "gateway-new-key"


def _targets() -> list[tuple[str, str, str]]:
    """Every deployment's models: ("<deployment id>/<model>", its words, its kind)."""
    rows = DeploymentModel.objects.select_related("deployment", "registered_model").order_by(
        "deployment__name", "triton_name"
    )
    return [
        (f"{p.deployment_id}/{p.triton_name}", f"{p.deployment.name} / {p.triton_name} ({p.registered_model.kind})",
         p.registered_model.kind)
        for p in rows
    ]  # fmt: skip


def _with_moves(aliases: list[Alias]) -> list[Alias]:
    """Each alias with where it may move: models of the kind it serves now (a chat
    client cannot be handed an embedder), its own target chosen."""
    targets = _targets()
    kind_of = {value: kind for value, _, kind in targets}
    for alias in aliases:
        alias.current_target = f"{alias.deployment_id}/{alias.triton_name}"
        kind = kind_of.get(alias.current_target)
        alias.move_choices = [(value, words) for value, words, other in targets if other == kind]
    return aliases


class AliasForm(forms.Form):
    name = forms.CharField(max_length=128, validators=[alias_validator], help_text="what clients send as model")
    target = forms.ChoiceField(label="Serves", help_text="a model of a deployment")

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.fields["target"].choices = [(value, words) for value, words, _ in _targets()]


class MoveForm(forms.Form):
    alias = forms.IntegerField(widget=forms.HiddenInput)
    target = forms.ChoiceField(label="Move to")

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.fields["target"].choices = [(value, words) for value, words, _ in _targets()]


class KeyForm(forms.Form):
    name = forms.CharField(max_length=100)
    all_aliases = forms.BooleanField(required=False, label="All aliases (present and future)")
    aliases = forms.MultipleChoiceField(required=False, help_text="or only these")
    expires_at = forms.DateTimeField(
        required=False, label="Expires (UTC)", widget=forms.DateTimeInput(attrs={"type": "datetime-local"})
    )
    requests_per_minute = forms.IntegerField(required=False, min_value=1, max_value=10_000_000)
    tokens_per_minute = forms.IntegerField(required=False, min_value=1, max_value=2_000_000_000)

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.fields["aliases"].choices = [(a, a) for a in Alias.objects.values_list("name", flat=True)]

    def clean_expires_at(self) -> dt.datetime | None:
        value = self.cleaned_data["expires_at"]
        return value.replace(tzinfo=dt.timezone.utc) if value is not None and timezone.is_naive(value) else value


def _split(target: str) -> tuple[int, str]:
    deployment, _, model = target.partition("/")
    return int(deployment), model


@login_required
def gateway_page(request: HttpRequest) -> HttpResponse:
    action = request.POST.get("action") if request.method == "POST" else None
    operate = can_operate(request.user)
    alias_form = AliasForm(request.POST if action == "alias" else None)
    key_form = KeyForm(request.POST if action == "key" else None)
    new_secret = request.session.pop(_NEW_SECRET, None) if request.method == "GET" else None
    try:
        if action and not operate:
            messages.error(request, "Changing the gateway needs the operator role.")
        elif action == "alias" and alias_form.is_valid():
            deployment_id, model = _split(alias_form.cleaned_data["target"])
            services.alias_create(
                name=alias_form.cleaned_data["name"], deployment_id=deployment_id, triton_name=model, user=request.user
            )
            messages.success(request, f"Alias {alias_form.cleaned_data['name']} created.")
            return redirect("gateway")
        elif action == "move":
            move = MoveForm(request.POST)
            if move.is_valid():
                deployment_id, model = _split(move.cleaned_data["target"])
                services.alias_move(
                    alias_id=move.cleaned_data["alias"],
                    deployment_id=deployment_id,
                    triton_name=model,
                    user=request.user,
                )
                messages.success(request, "Alias moved: every client follows within a second.")
            return redirect("gateway")
        elif action == "delete-alias":
            services.alias_delete(alias_id=int(request.POST.get("alias", 0)), user=request.user)
            messages.success(request, "Alias deleted.")
            return redirect("gateway")
        elif action == "revoke":
            key = services.key_revoke(key_id=int(request.POST.get("key", 0)), user=request.user)
            messages.success(request, f"Key {key.name} revoked.")
            return redirect("gateway")
        elif action == "key" and key_form.is_valid():
            data = key_form.cleaned_data
            created = services.key_create(
                name=data["name"],
                user=request.user,
                all_aliases=data["all_aliases"],
                alias_names=data["aliases"],
                expires_at=data["expires_at"],
                requests_per_minute=data["requests_per_minute"],
                tokens_per_minute=data["tokens_per_minute"],
            )
            # Post/redirect/get, so a reload cannot make a second key: the secret waits in
            # the server-side session for the next page and is removed when shown.
            request.session[_NEW_SECRET] = created.secret
            return redirect("gateway")
    except GantryError as exc:
        form = key_form if action == "key" else alias_form
        if action in ("alias", "key"):
            show_refusal(form, exc)
        else:
            messages.error(request, str(exc))
    since = timezone.now().date() - dt.timedelta(days=USAGE_DAYS)
    return render(
        request,
        "gateway/gateway.html",
        {
            "aliases": _with_moves(list(Alias.objects.select_related("deployment").order_by("name"))),
            "keys": keys_with_usage(),
            "usage": Usage.objects.select_related("key").filter(day__gte=since)[:500],
            "usage_days": USAGE_DAYS,
            "alias_form": alias_form,
            "key_form": key_form,
            "new_secret": new_secret,
            "can_operate": operate,
            "base_url": request.build_absolute_uri("/v1"),
        },
    )
