"""Browser pages. Live parts (status, timeline, playground) are driven by
static/gantry.js over the REST API and the websocket."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render

from deployments import selectors
from deployments.errors import GantryError
from deployments.models import GENERATIVE_BACKENDS, ModelKind, RegisteredModel
from deployments.permissions import can_operate
from deployments.services import builds, deployments
from deployments.services.placements import SERVABLE_KINDS, PlacementSpec
from deployments.web.forms import BuildForm, DeployForm, show_refusal


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


def _build_from_form(request: HttpRequest, model: RegisteredModel, form: BuildForm) -> HttpResponse | None:
    data = form.cleaned_data
    try:
        build, how = builds.build_request(
            model=model.name,
            host=data["host"],
            image=data["image"],
            spec={name: data[name] for name in BuildForm.SPEC_FIELDS},
            force=data["force"],
            user=request.user,
        )
    except GantryError as exc:
        show_refusal(form, exc)
        return None
    notes = {
        "queued": "Build queued.",
        "cached": "An identical engine was already built: this is it (tick 'rebuild' to compile again).",
        "joined": "An identical build is already running: this is it.",
    }
    messages.success(request, notes[how])
    return redirect("build", pk=build.pk)


@login_required
def model_detail(request: HttpRequest, pk: int) -> HttpResponse:
    model = get_object_or_404(selectors.model_list(), pk=pk)
    build_form = BuildForm(request.POST if "build" in request.POST else None)
    if request.method == "POST" and "build" in request.POST and build_form.is_valid():
        done = _build_from_form(request, model, build_form)
        if done is not None:
            return done
    form = DeployForm(
        request.POST if "deploy" in request.POST else None,
        model=model,
        initial={"name": model.name.replace(".", "-")[:50]},
    )
    if request.method == "POST" and "deploy" in request.POST and form.is_valid():
        data = form.cleaned_data
        try:
            deployment = deployments.deployment_create(
                name=data["name"],
                host_name=data["host"],
                runtime=data["runtime"],
                image=data["image"],
                placements=[
                    PlacementSpec(
                        model=name,
                        max_batch_size=data["max_batch_size"],
                        max_queue_delay_us=data["max_queue_delay_us"],
                        instance_count=data["instance_count"],
                        instance_kind=data["instance_kind"],
                        engine_build=int(data["engine_build"])
                        if name == model.name and data.get("engine_build")
                        else None,
                    )
                    for name in [model.name, *data["also"]]
                ],
                user=request.user,
            )
        except GantryError as exc:
            show_refusal(form, exc)
        else:
            messages.success(request, f"Deployment {deployment.name} created; press Start to launch it.")
            return redirect("deployment", pk=deployment.pk)
    return render(
        request,
        "deployments/model_detail.html",
        {
            "model": model,
            "form": form,
            "build_form": build_form,
            "servable": model.kind in SERVABLE_KINDS,
            "buildable": model.kind == ModelKind.LLM,
            "builds": selectors.build_list(model=model.name)[:20],
            "can_operate": can_operate(request.user),
            "placements": model.placements.select_related("deployment"),
        },
    )


@login_required
def build_detail(request: HttpRequest, pk: int) -> HttpResponse:
    build = get_object_or_404(selectors.build_list(), pk=pk)
    return render(
        request,
        "deployments/build_detail.html",
        {
            "build": build,
            "can_operate": can_operate(request.user),
            "placements": build.placements.select_related("deployment"),
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
            "llms": [p for p in deployment.placements.all() if p.backend in GENERATIVE_BACKENDS],
            "embedders": [p for p in deployment.placements.all() if p.registered_model.kind == ModelKind.EMBEDDING],
            "rerankers": [p for p in deployment.placements.all() if p.registered_model.kind == ModelKind.RERANKER],
            "plan": selectors.deployment_plan(deployment),
        },
    )
