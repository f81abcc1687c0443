"""Browser pages. Live parts (status, timeline, playground) are driven by
static/gantry.js over the REST API and the websocket."""

from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render

from deployments import builds, selectors, services, trtllm
from deployments.errors import GantryError, ValidationFailed
from deployments.models import BuildStatus, InstanceKind, ModelKind, RegisteredModel, Runtime
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
        if model.kind == ModelKind.LLM:
            built = model.builds.filter(status=BuildStatus.SUCCEEDED).order_by("-finished_at")
            self.fields["engine_build"] = forms.ChoiceField(
                label="Engine build",
                choices=[
                    (b.pk, f"build {b.pk}: {b.builder_image}, SM {b.compute_capability}, tp {b.tp_size}") for b in built
                ],
                help_text="served in the image it was built in (runtime docker)",
            )


class BuildForm(forms.Form):
    """The build request of the model page; the rules are deployments.builds'."""

    host = forms.ChoiceField()
    image = forms.ChoiceField(label="Builder image", help_text="allow-listed, present on the host")
    dtype = forms.ChoiceField(choices=[(d, d) for d in trtllm.DTYPES])
    quantization = forms.ChoiceField(choices=[(q, q) for q in trtllm.QUANTIZATIONS])
    gemm_plugin = forms.ChoiceField(choices=[(c, c) for c in trtllm.PLUGIN_CHOICES])
    gpt_attention_plugin = forms.ChoiceField(choices=[(c, c) for c in trtllm.PLUGIN_CHOICES])
    paged_context_fmha = forms.BooleanField(required=False, initial=True)
    max_batch_size = forms.IntegerField(min_value=1, max_value=4096, initial=builds.DEFAULTS["max_batch_size"])
    max_input_len = forms.IntegerField(min_value=1, initial=builds.DEFAULTS["max_input_len"])
    max_seq_len = forms.IntegerField(min_value=1, initial=builds.DEFAULTS["max_seq_len"])
    max_num_tokens = forms.IntegerField(min_value=1, initial=builds.DEFAULTS["max_num_tokens"])
    tp_size = forms.IntegerField(min_value=1, max_value=64, initial=1)
    pp_size = forms.IntegerField(min_value=1, max_value=64, initial=1)
    workers = forms.IntegerField(min_value=1, max_value=64, initial=1)
    allow_seq_len_over_max_positions = forms.BooleanField(required=False, label="Allow max_seq_len over max positions")
    force = forms.BooleanField(required=False, label="Rebuild even if an identical engine exists")

    SPEC_FIELDS = (
        "dtype", "quantization", "gemm_plugin", "gpt_attention_plugin", "paged_context_fmha", "max_batch_size",
        "max_input_len", "max_seq_len", "max_num_tokens", "tp_size", "pp_size", "workers",
        "allow_seq_len_over_max_positions",
    )  # fmt: skip

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        hosts = list(selectors.host_list())
        self.fields["host"].choices = [(h.name, f"{h.name} ({h.gpus.count()} GPU)") for h in hosts]
        images = sorted({image for h in hosts for image in builds.builder_choices(h)})
        self.fields["image"].choices = [(i, i) for i in images]


def _form_errors(form: forms.Form, exc: GantryError) -> None:
    """A service's refusal, shown on the form: each rule beside its field where the form has it."""
    if isinstance(exc, ValidationFailed):
        for field, errors in exc.errors.items():
            form.add_error(field if field in form.fields else None, " ".join(errors))
    else:
        form.add_error(None, str(exc))


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
        _form_errors(form, exc)
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
                        engine_build=int(data["engine_build"])
                        if name == model.name and data.get("engine_build")
                        else None,
                    )
                    for name in [model.name, *data["also"]]
                ],
                user=request.user,
            )
        except GantryError as exc:
            _form_errors(form, exc)
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
            "servable": model.kind in services.SERVABLE_KINDS,
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
            "embedders": [p for p in deployment.placements.all() if p.registered_model.kind == ModelKind.EMBEDDING],
            "rerankers": [p for p in deployment.placements.all() if p.registered_model.kind == ModelKind.RERANKER],
            "plan": selectors.deployment_plan(deployment),
        },
    )
