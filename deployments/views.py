"""Browser pages. Live parts (status, timeline, playground) are driven by
static/gantry.js over the REST API and the websocket."""

from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render

from deployments import selectors, services
from deployments.errors import GantryError, ValidationFailed
from deployments.models import InstanceKind, ModelKind, RegisteredModel, Runtime
from deployments.permissions import can_operate


@login_required
def dashboard(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "deployments/dashboard.html",
        {
            "hosts": selectors.host_list(),
            "models": selectors.model_list(),
            "deployments": selectors.deployment_list(),
        },
    )


class DeployForm(forms.Form):
    name = forms.SlugField(max_length=63, help_text="lowercase letters, digits, '-' and '_'")
    host = forms.ChoiceField()
    runtime = forms.ChoiceField(choices=Runtime.choices, initial=Runtime.PROCESS)
    image = forms.ChoiceField(required=False, help_text="Triton image for the docker runtime (allow-listed)")
    max_batch_size = forms.IntegerField(min_value=1, max_value=4096, initial=32)
    max_queue_delay_us = forms.IntegerField(
        min_value=0, max_value=10_000_000, initial=2000, label="Max queue delay (µs)"
    )
    instance_count = forms.IntegerField(min_value=1, max_value=64, initial=1)
    instance_kind = forms.ChoiceField(choices=InstanceKind.choices, initial=InstanceKind.AUTO)
    also = forms.MultipleChoiceField(
        required=False,
        label="Also serve in the same Triton server",
        widget=forms.CheckboxSelectMultiple,
    )

    def __init__(self, *args, model: RegisteredModel, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.fields["host"].choices = [(h.name, h.name) for h in selectors.host_list()]
        self.fields["image"].choices = [("", "—")] + [(i, i) for i in settings.GANTRY_ALLOWED_IMAGES]
        others = selectors.model_list().filter(kind__in=services.SERVABLE_KINDS).exclude(pk=model.pk)
        self.fields["also"].choices = [(m.name, f"{m.name} ({m.kind})") for m in others]


@login_required
def model_detail(request: HttpRequest, pk: int) -> HttpResponse:
    model = get_object_or_404(selectors.model_list(), pk=pk)
    form = DeployForm(request.POST or None, model=model, initial={"name": model.name.replace(".", "-")[:50]})
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            deployment = services.deployment_create(
                name=data["name"],
                host_name=data["host"],
                runtime=data["runtime"],
                image=data["image"],
                placements=[
                    services.PlacementSpec(
                        model=name,
                        max_batch_size=data["max_batch_size"],
                        max_queue_delay_us=data["max_queue_delay_us"],
                        instance_count=data["instance_count"],
                        instance_kind=data["instance_kind"],
                    )
                    for name in [model.name, *data["also"]]
                ],
                user=request.user,
            )
        except ValidationFailed as exc:
            for field, errors in exc.errors.items():
                form.add_error(field if field in form.fields else None, " ".join(errors))
        except GantryError as exc:
            form.add_error(None, str(exc))
        else:
            messages.success(request, f"Deployment {deployment.name} created; press Start to launch it.")
            return redirect("deployment", pk=deployment.pk)
    return render(
        request,
        "deployments/model_detail.html",
        {
            "model": model,
            "form": form,
            "can_operate": can_operate(request.user),
            "placements": model.placements.select_related("deployment"),
        },
    )


@login_required
def deployment_detail(request: HttpRequest, pk: int) -> HttpResponse:
    deployment = get_object_or_404(selectors.deployment_list(), pk=pk)
    return render(
        request,
        "deployments/deployment_detail.html",
        {
            "deployment": deployment,
            "can_operate": can_operate(request.user),
            "embedders": [p for p in deployment.placements.all() if p.registered_model.kind == ModelKind.EMBEDDING],
            "rerankers": [p for p in deployment.placements.all() if p.registered_model.kind == ModelKind.RERANKER],
            "plan": selectors.deployment_plan(deployment),
        },
    )
