"""Browser pages. Live parts (status, timeline, playground) are driven by
static/gantry.js over the REST API and the websocket."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db.models import QuerySet
from django.forms import Form
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.html import format_html_join

from common.errors import GantryError
from core.permissions import OPERATOR_REQUIRED, can_operate
from deployments import selectors, states
from deployments.backends import GENERATIVE_BACKENDS, SERVABLE_KINDS
from deployments.models import (
    AutoscaleMetric,
    BuildStatus,
    DecodingMode,
    DeploymentModel,
    Dtype,
    Inspection,
    InstanceKind,
    ModelKind,
    RegisteredModel,
    SchedulerPolicy,
    TimeoutAction,
)
from deployments.services import builds, registered_models
from deployments.services.autoscale import AutoscaleSpec, describe
from deployments.services.deployments import ServerSpec
from deployments.services.placements import placements_snapshot
from deployments.web.forms import (
    BuildFilterForm,
    BuildForm,
    DashboardFilterForm,
    EventFilterForm,
    RegisterForm,
    show_refusal,
)
from hosts import selectors as host_selectors

# The colors of the dashboard's memory bars, one per deployment (static/gantry.css has none to spare).
_SHARE_COLORS = ("#2457c5", "#c4320a", "#087443", "#6938ef", "#b54708", "#0e7090", "#c11574")


# The dashboard shows a page of hosts and a page of deployments (a fleet of
# thousands stays a page of each), with counts of everything above them.
DASHBOARD_HOSTS, DASHBOARD_DEPLOYMENTS = 20, 50


@login_required
def dashboard(request: HttpRequest) -> HttpResponse:
    """A summary of the fleet; a page of hosts, each GPU as a memory bar split by
    the replicas placed on it (and what it really uses, live); a page of
    deployments (searched by name, filtered by status or host) with their
    replicas, status and request-rate sparkline, live for the rows in view."""
    query = DashboardFilterForm(request.GET or None)
    found = query.cleaned_data if query.is_valid() else {}
    hosts_page = Paginator(host_selectors.host_list(), DASHBOARD_HOSTS).get_page(request.GET.get("hosts_page"))
    rows = selectors.deployment_search(
        name=found.get("q") or "", status=found.get("status") or "", host=found.get("host") or ""
    )
    deployments_page = Paginator(rows, DASHBOARD_DEPLOYMENTS).get_page(request.GET.get("page"))
    hosts = list(hosts_page)
    shares = selectors.gpu_shares_on(hosts)
    colors: dict[int, str] = {}

    def color(deployment_id: int) -> str:
        return colors.setdefault(deployment_id, _SHARE_COLORS[len(colors) % len(_SHARE_COLORS)])

    page_of = reverse("deployment", args=[0]).removesuffix("0/")
    for host in hosts:
        host.gpu_bars = []
        for gpu in host.gpus.all():
            placed = shares.get((host.pk, gpu.index), [])
            planned = sum(share["fraction"] for share in placed)
            used = gpu.memory_used_bytes / gpu.memory_total_bytes if gpu.memory_total_bytes else 0.0
            # The segments are built here, not in the template: a page of hosts at fleet
            # size carries some 2000 of them, and the template's per-variable cost was
            # half the page's time (docs/performance.md).
            label = ", ".join(f"{s['deployment']}/{s['model']} {round(s['fraction'] * 100, 1)}%" for s in placed)
            segments = format_html_join(
                "",
                '<a class="segment" href="{}{}/" style="width: {}%; background: {}" title="{} r{} / {}: {}%">{}</a>',
                (
                    (page_of, s["deployment_id"], pct, color(s["deployment_id"]), s["deployment"], s["replica"],
                     s["model"], pct, s["model"])
                    for s in placed
                    for pct in [round(s["fraction"] * 100, 1)]
                ),
            )  # fmt: skip
            host.gpu_bars.append(
                {"gpu": gpu, "label": label or "nothing placed", "segments": segments,
                 "planned_percent": round(planned * 100, 1), "used_percent": round(used * 100, 1)}
            )  # fmt: skip
    return render(
        request,
        "deployments/dashboard.html",
        {
            "summary": selectors.fleet_summary(),
            "hosts": hosts,
            "hosts_page": hosts_page,
            "models": selectors.model_list()[:20],
            "deployments": list(deployments_page),
            "deployments_page": deployments_page,
            "filters": query,
            "filtered": bool(found.get("q") or found.get("status") or found.get("host")),
            "can_operate": can_operate(request.user),
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
        show_refusal(form, exc, within="spec")
        return None
    notes = {
        "queued": "Build queued.",
        "cached": "An identical engine was already built: this is it (tick 'rebuild' to compile again).",
        "joined": "An identical build is already running: this is it.",
    }
    messages.success(request, notes[how])
    return redirect("build", pk=build.pk)


@login_required
def model_list(request: HttpRequest) -> HttpResponse:
    """Registered models, and the form that registers a checkpoint folder on a host."""
    form = RegisterForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            model = registered_models.model_register(**form.cleaned_data, user=request.user)
        except GantryError as exc:
            show_refusal(form, exc)
        else:
            messages.success(request, f"{model.name} registered: its host is inspecting it.")
            return redirect("model", pk=model.pk)
    return render(
        request,
        "deployments/models.html",
        {"models": selectors.model_list(), "form": form, "can_operate": can_operate(request.user)},
    )


@login_required
def model_detail(request: HttpRequest, pk: int) -> HttpResponse:
    model = get_object_or_404(selectors.model_list(), pk=pk)
    build_form = BuildForm(request.POST or None)
    if request.method == "POST" and build_form.is_valid():
        done = _build_from_form(request, model, build_form)
        if done is not None:
            return done
    return render(
        request,
        "deployments/model_detail.html",
        {
            "model": model,
            "copies": model.copies.all(),
            "downloads": model.downloads.all(),
            "downloads_active": any(d.status in states.DOWNLOAD_ACTIVE for d in model.downloads.all()),
            "hosts": host_selectors.host_list(),
            "build_form": build_form,
            "servable": model.kind in SERVABLE_KINDS,
            "buildable": model.kind == ModelKind.LLM,
            "builds": selectors.build_list(model=model.name)[:20],
            "can_operate": can_operate(request.user),
            "placements": model.placements.select_related("deployment"),
            "spec_fields": json.dumps(BuildForm.SPEC_FIELDS),
        },
    )


ROWS_PER_PAGE = 100


def _filtered_page(request: HttpRequest, form: Form, rows: QuerySet, filter_rows: Callable) -> tuple[list, str | None]:
    """A page of ``rows`` (newest first) filtered by ``form`` through ``filter_rows``
    (none when the filters are invalid: the form says why), below the id ``before``,
    and the query string of the next older page."""
    before = None
    if form.is_valid():
        given = {k: v for k, v in form.cleaned_data.items() if v not in (None, "")}
        before = given.pop("before", None)
        rows = filter_rows(rows, **given)
    elif form.is_bound:
        rows = rows.none()
    if before:
        rows = rows.filter(id__lt=before)
    page = list(rows[: ROWS_PER_PAGE + 1])
    if len(page) <= ROWS_PER_PAGE:
        return page, None
    page = page[:ROWS_PER_PAGE]
    query = request.GET.copy()
    query["before"] = page[-1].pk
    return page, query.urlencode()


@login_required
def build_list(request: HttpRequest) -> HttpResponse:
    """Engine builds, newest first, by model, status and host."""
    form = BuildFilterForm(request.GET or None)
    builds, older = _filtered_page(request, form, selectors.build_list().order_by("-id"), selectors.build_filter)
    return render(request, "deployments/builds.html", {"form": form, "builds": builds, "older": older})


@login_required
def event_list(request: HttpRequest) -> HttpResponse:
    """The audit timeline, newest first, filtered by object, user and kind; older pages by cursor."""
    form = EventFilterForm(request.GET or None)
    rows = selectors.event_list().select_related("actor", "deployment", "build", "model").order_by("-id")
    events, older = _filtered_page(request, form, rows, selectors.event_filter)
    return render(request, "deployments/events.html", {"form": form, "events": events, "older": older})


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
    ejections = selectors.replica_ejections(deployment.pk)
    for replica in deployment.replica_set.all():
        replica.ejections = ejections.get(replica.serial, 0)
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
            "autoscale_words": describe(AutoscaleSpec.of(deployment)),
            "autoscale_metrics": AutoscaleMetric.choices,
            "change_options": deploy_form_options(
                mode="change",
                initial=placements_snapshot(deployment),
                deploymentId=deployment.pk,
                deployment={
                    "host": selectors.reference_host_name(deployment),
                    "runtime": deployment.runtime,
                    "image": deployment.image,
                },  # fmt: skip
            ),
        },
    )


# The numeric settings of a placement the deploy form offers, with DeploymentModel's bounds.
_FORM_NUMBERS = (
    "gpu_memory_fraction", "instance_count", "max_batch_size", "max_queue_delay_us", "priority_levels",
    "default_priority_level", "queue_timeout_us", "max_queue_size", "max_seq_len", "max_num_sequences",
    "kv_cache_free_gpu_mem_fraction", "max_tokens_in_paged_kv_cache",
)  # fmt: skip


def _bounds(name: str) -> dict[str, Any]:
    field = DeploymentModel._meta.get_field(name)
    bound = {"default": field.get_default(), "min": 0}
    for validator in field.validators:
        if isinstance(validator, MinValueValidator):
            bound["min"] = validator.limit_value
        if isinstance(validator, MaxValueValidator):
            bound["max"] = validator.limit_value
    return bound


def deploy_form_options(*, mode: str, initial: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """What static/deploy-form.js draws its form from: hosts and their GPUs, the
    models it can place (inspected, of a servable kind, with an llm's succeeded
    builds), allow-listed images, and each setting's bounds and default."""
    models = selectors.model_list().filter(kind__in=SERVABLE_KINDS, inspection=Inspection.READY)
    builds_by_model: dict[int, list[dict[str, Any]]] = {}
    for build in selectors.build_list().filter(status=BuildStatus.SUCCEEDED, model__kind=ModelKind.LLM):
        builds_by_model.setdefault(build.model_id, []).append(
            {"id": build.pk, "label": f"{build.builder_image}, SM {build.compute_capability}, tp {build.tp_size}"}
        )
    fields = {name: _bounds(name) for name in _FORM_NUMBERS}
    for name in ("instance_kind", "batch_scheduler_policy", "decoupled", "timeout_action", "dtype",
                 "enable_kv_cache_reuse", "decoding_mode"):  # fmt: skip
        fields[name] = {"default": DeploymentModel._meta.get_field(name).get_default()}
    return {
        "mode": mode,
        "initial": initial,
        "fields": fields,
        "instance_kinds": InstanceKind.choices,
        "scheduler_policies": SchedulerPolicy.choices,
        "timeout_actions": TimeoutAction.choices,
        "dtypes": Dtype.choices,
        "decoding_modes": DecodingMode.choices,
        "models": [
            {"name": m.name, "kind": m.kind, "notice": m.notice, "builds": builds_by_model.get(m.pk, [])}
            for m in models
        ],
        **extra,
    }


@login_required
def deployment_new(request: HttpRequest) -> HttpResponse:
    """The deploy form: several models on one host, planned live by the server (static/deploy-form.js)."""
    if not can_operate(request.user):
        raise PermissionDenied(OPERATOR_REQUIRED)
    wanted = request.GET.get("model", "")
    return render(
        request,
        "deployments/deployment_new.html",
        {
            "hosts": host_selectors.host_list(),
            "images": settings.GANTRY_ALLOWED_IMAGES,
            "server": ServerSpec(),
            "options": deploy_form_options(mode="create", initial=[{"model": wanted}] if wanted else []),
        },
    )
