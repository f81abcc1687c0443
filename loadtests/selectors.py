"""Reads of load tests: lists, one run with its steps, and the comparison of
several runs (their figures side by side, and what differs between them); and
of tuning runs: their trials, what the search found, and its export."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from common.errors import NotFound, ValidationFailed
from loadtests import tuning
from loadtests.models import LoadPoint, LoadTest, TuningRun

MAX_COMPARED = 8

# The columns of a comparison table and its export, one row per step.
COLUMNS = (
    ("request_throughput", "requests/s"),
    ("output_token_throughput", "output tokens/s"),
    ("goodput", "goodput (requests/s)"),
    ("request_latency.p50", "latency p50 ms"),
    ("request_latency.p90", "latency p90 ms"),
    ("request_latency.p99", "latency p99 ms"),
    ("time_to_first_token.p50", "TTFT p50 ms"),
    ("time_to_first_token.p90", "TTFT p90 ms"),
    ("time_to_first_token.p99", "TTFT p99 ms"),
    ("inter_token_latency.p50", "ITL p50 ms"),
    ("inter_token_latency.p90", "ITL p90 ms"),
    ("inter_token_latency.p99", "ITL p99 ms"),
    ("output_token_throughput_per_user.p50", "tokens/s per user p50"),
    ("counted.requests", "requests"),
    ("counted.errors", "errors"),
)


def ids_in(text: str) -> list[int]:
    """The run ids of a comma-separated ``ids`` parameter (the API's and the comparison page's)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isdigit() for part in parts) or len(parts) > MAX_COMPARED:
        raise ValidationFailed({"ids": f"1 to {MAX_COMPARED} load test ids, comma-separated"})
    return [int(part) for part in parts]


def run_list() -> QuerySet[LoadTest]:
    return LoadTest.objects.select_related("created_by").order_by("-id")


def run_filter(
    rows: QuerySet[LoadTest], *, deployment: int | None = None, status: str | None = None, alias: str | None = None
) -> QuerySet[LoadTest]:
    if deployment is not None:
        rows = rows.filter(deployment_id=deployment)
    if status:
        rows = rows.filter(status=status)
    if alias:
        rows = rows.filter(alias=alias)
    return rows


def run_get(run_id: int) -> LoadTest:
    run = run_list().filter(pk=run_id).first()
    if run is None:
        raise NotFound(f"load test {run_id} does not exist")
    return run


def points_of(run_ids: list[int]) -> dict[int, list[LoadPoint]]:
    """Each run's steps without their per-request records (one query)."""
    found: dict[int, list[LoadPoint]] = {run_id: [] for run_id in run_ids}
    for point in LoadPoint.objects.filter(run_id__in=run_ids).defer("records").order_by("run_id", "target", "level"):
        found[point.run_id].append(point)
    return found


def figure(summary: dict[str, Any], path: str) -> Any:
    """``summary``'s value at a dotted ``path`` (None when absent)."""
    value: Any = summary
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    """A nested value as {dotted path: leaf}; placements are keyed by their Triton name."""
    if isinstance(value, dict):
        found: dict[str, Any] = {}
        for key, inner in value.items():
            found.update(_flat(inner, f"{prefix}.{key}" if prefix else str(key)))
        return found
    if isinstance(value, list) and value and all(isinstance(v, dict) and "triton_name" in v for v in value):
        return _flat({v["triton_name"]: v for v in value}, prefix)
    return {prefix: value}


# Parts of a run's record that tell runs apart without being a setting.
_NOT_SETTINGS = ("context.deployment.id", "context.host.gpus")


def comparison(run_ids: list[int]) -> dict[str, Any]:
    """Runs side by side: each with its steps' figures, and every setting
    (workload, generation, builds, batching, fractions, image, GPUs, versions)
    whose value is not the same in all of them."""
    if not 2 <= len(set(run_ids)) <= MAX_COMPARED:
        raise ValidationFailed({"ids": f"name 2 to {MAX_COMPARED} different load tests"})
    runs = {run.pk: run for run in run_list().filter(pk__in=run_ids)}
    missing = [str(i) for i in run_ids if i not in runs]
    if missing:
        raise ValidationFailed({"ids": f"no load test {', '.join(missing)}"})
    ordered = [runs[i] for i in dict.fromkeys(run_ids)]
    points = points_of([run.pk for run in ordered])
    flats = [
        {k: v for k, v in _flat({"workload": r.workload, "context": r.context}, "").items()
         if not k.startswith(_NOT_SETTINGS) and k != "workload.dataset"}
        for r in ordered
    ]  # fmt: skip
    differences = []
    for key in sorted(set().union(*flats)):
        values = [flat.get(key) for flat in flats]
        if any(v != values[0] for v in values[1:]):
            differences.append({"field": key, "values": values})
    return {
        "runs": [_shown(run, points[run.pk]) for run in ordered],
        "columns": [{"key": key, "label": text} for key, text in COLUMNS],
        "differences": differences,
    }


def _shown(run: LoadTest, points: list[LoadPoint]) -> dict[str, Any]:
    """A run as comparisons and exports show it: who, what, and each step's figures."""
    return {
        "id": run.pk,
        "label": label(run),
        "alias": run.alias,
        "deployment": run.deployment_name,
        "generation": figure(run.context, "deployment.generation"),
        "status": run.status,
        "workload": run.workload,
        "points": [point_row(p) for p in points],
        "ceiling": ceiling(points),
    }


def ceiling(points: list[LoadPoint]) -> list[dict[str, Any]]:
    """Served against native at each level both ran: each served step's output
    token and request throughput over trtllm-bench's on the same engine and
    workload (1.0 means serving costs nothing; the rest is Triton, the
    tokenizer models, the gateway and HTTP)."""
    native = {p.level: p.summary for p in points if p.target == LoadPoint.Target.NATIVE}
    rows = []
    for point in points:
        if point.target == LoadPoint.Target.NATIVE or point.level not in native:
            continue
        row: dict[str, Any] = {"target": point.target, "level": point.level}
        for name in ("output_token_throughput", "request_throughput"):
            served, best = point.summary.get(name), native[point.level].get(name)
            row[name] = {
                "served": served,
                "native": best,
                "ratio": round(served / best, 3) if served and best else None,
            }
        rows.append(row)
    return rows


def label(run: LoadTest) -> str:
    return f"#{run.pk} {run.alias} on {run.deployment_name} (gen {figure(run.context, 'deployment.generation')})"


def point_row(point: LoadPoint) -> dict[str, Any]:
    return {
        "target": point.target,
        "level": point.level,
        "complete": point.complete,
        "figures": {key: figure(point.summary, key) for key, _ in COLUMNS},
    }


def export_rows(run_ids: list[int]) -> list[dict[str, Any]]:
    """One flat row per step of each run, for CSV and JSON export."""
    if len(run_ids) > 1:
        runs = comparison(run_ids)["runs"]
    else:
        run = run_get(run_ids[0])
        runs = [_shown(run, points_of([run.pk])[run.pk])]
    rows = []
    for run in runs:
        ratios = {(row["target"], row["level"]): row["output_token_throughput"]["ratio"] for row in run["ceiling"]}
        for point in run["points"]:
            row = {"run": run["id"], "alias": run["alias"], "deployment": run["deployment"],
                   "generation": run["generation"], "mode": run["workload"]["mode"], "target": point["target"],
                   "level": point["level"], "complete": point["complete"]}  # fmt: skip
            row.update(point["figures"])
            row["served_over_native"] = ratios.get((point["target"], point["level"]))
            rows.append(row)
    return rows


# --- tuning runs -----------------------------------------------------------------


def tuning_list() -> QuerySet[TuningRun]:
    return TuningRun.objects.select_related("created_by").order_by("-id")


def tuning_summaries(limit: int = 200) -> list[TuningRun]:
    """The newest runs, each with its best trial (``best``, or None) and whether
    that trial met every target (``met``), in two queries."""
    runs = list(tuning_list().prefetch_related("trials")[:limit])
    for run in runs:
        trials = list(run.trials.all())
        run.best = tuning.best(trials)
        run.met = tuning.met(run.best)
    return runs


def tuning_get(run_id: int) -> TuningRun:
    run = tuning_list().filter(pk=run_id).first()
    if run is None:
        raise NotFound(f"tuning run {run_id} does not exist")
    return run


def tuning_result(run: TuningRun) -> dict[str, Any]:
    """What a run found: its trials for the trade-off chart (goodput against
    GPU memory; each model's p99 against its target), the best trial, whether
    it met every target, and what the best plan changes against the starting one."""
    trials = list(run.trials.order_by("number"))
    chosen = tuning.best(trials)
    baseline = next((t for t in trials if t.number == 0), None)
    return {
        "best": None if chosen is None else chosen.number,
        "baseline": None if baseline is None else baseline.number,
        "gain": round(chosen.goodput / baseline.goodput, 3)
        if chosen is not None and baseline is not None and baseline.goodput
        else None,
        "changes": [] if chosen is None else tuning.differences(run.start_plan, chosen.plan),
        # The most goodput is not a verdict: every trial may have missed its targets.
        "met": tuning.met(chosen),
    }


def tuning_rows(run: TuningRun) -> list[dict[str, Any]]:
    """One flat row per trial, for CSV and JSON export: its values, how it
    ended, its goodput and GPU memory, and each model's p99s against targets."""
    rows = []
    for trial in run.trials.order_by("number"):
        row: dict[str, Any] = {"run": run.pk, "trial": trial.number, "status": trial.status,
                               "generation": trial.generation, "goodput": trial.goodput,
                               "gpu_share": trial.gpu_share}  # fmt: skip
        row.update({f"param.{name}": value for name, value in trial.params.items()})
        for alias, figures in trial.figures.items():
            row[f"{alias}.goodput"] = figures.get("goodput")
            row[f"{alias}.throughput"] = figures.get("throughput")
            row[f"{alias}.errors"] = figures.get("errors")
            for name, value in (figures.get("p99") or {}).items():
                row[f"{alias}.{name}.p99"] = value
                row[f"{alias}.{name}.target"] = figures["targets"][name]
        row["reason"] = trial.reason
        rows.append(row)
    return rows
