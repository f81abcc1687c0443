"""The load-test pages: the list, one run, and runs compared; and the tuning
runs' list and one tuning run. The deployment page holds the forms that start them
(templates/loadtests/_form.html and _tuning.html)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from common.errors import NotFound, ValidationFailed
from core.permissions import can_operate
from loadtests import selectors, workload


@login_required
def loadtest_list(request: HttpRequest) -> HttpResponse:
    runs = list(selectors.run_list()[:200])
    return render(request, "loadtests/list.html", {"runs": runs})


@login_required
def loadtest_detail(request: HttpRequest, pk: int) -> HttpResponse:
    try:
        run = selectors.run_get(pk)
    except NotFound as exc:
        raise Http404(str(exc)) from exc
    columns = [{"key": key, "label": text} for key, text in selectors.COLUMNS]
    return render(
        request,
        "loadtests/detail.html",
        {
            "run": run,
            "columns": columns,
            "workload_words": workload.describe(run.workload),
            "can_operate": can_operate(request.user),
        },
    )


@login_required
def loadtest_compare(request: HttpRequest) -> HttpResponse:
    ids: list[int] = []
    try:
        ids = selectors.ids_in(request.GET.get("ids", ""))
        compared = selectors.comparison(ids)
        error = ""
    except ValidationFailed as exc:
        compared, error = None, " ".join(m for ms in exc.errors.values() for m in ms)
    context = {"compared": compared, "error": error, "ids": ",".join(map(str, ids))}
    return render(request, "loadtests/compare.html", context)


@login_required
def tuning_list(request: HttpRequest) -> HttpResponse:
    return render(request, "loadtests/tuning_list.html", {"runs": selectors.tuning_summaries()})


@login_required
def tuning_detail(request: HttpRequest, pk: int) -> HttpResponse:
    try:
        run = selectors.tuning_get(pk)
    except NotFound as exc:
        raise Http404(str(exc)) from exc
    return render(request, "loadtests/tuning.html", {"run": run, "can_operate": can_operate(request.user)})
