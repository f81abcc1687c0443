"""What a tuning run may ask for, and the search's arithmetic.

A tuning run holds a deployment under a traffic mix (a request rate per gateway
alias) and searches some of its placements' settings (the "knobs"). Each trial
is a plan: the run's starting placements with the knobs' values set. This
module checks the spec by field, turns values into plans, scores a trial's
load from its per-request records (goodput: requests per second that met every
target of their model, all aliases together), and picks the next values: every
point of the grid in turn when the grid fits the run's trial bound, else
optuna's TPE sampler, which learns from the trials so far (pruned and failed
ones included), replayed from the database each time so a restarted worker
picks up where the last one stopped.

Types and ranges are checked at the door (loadtests.api.TuningIn); the rules
that need the deployment are here.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from common.errors import ValidationFailed
from deployments.models import ModelKind
from loadtests import workload as workloads

# The knobs a run may search, and the type of their values.
KNOBS: dict[str, type] = {
    "max_batch_size": int,
    "preferred_batch_sizes": list,
    "max_queue_delay_us": int,
    "instance_count": int,
    "gpu_memory_fraction": float,
    "max_num_sequences": int,
    "kv_cache_free_gpu_mem_fraction": float,
    "max_tokens_in_paged_kv_cache": int,
    "engine_build": int,
}
# p99 targets by kind: the AIPerf metric each bounds (loadtests.workload.THRESHOLDS).
TARGETS = {
    ModelKind.LLM: ("time_to_first_token_ms", "inter_token_latency_ms", "request_latency_ms"),
    ModelKind.EMBEDDING: ("request_latency_ms",),
    ModelKind.RERANKER: ("request_latency_ms",),
}
# Which per-request record field each target reads (workers.loadtest.results.records_of).
RECORD_FIELD = {"time_to_first_token_ms": "ttft_ms", "inter_token_latency_ms": "itl_ms",
                "request_latency_ms": "latency_ms"}  # fmt: skip
# What a mix entry may say of its requests' shape (as a load test's workload does).
SHAPE = ("input_tokens", "output_tokens", "batch_size", "passages", "dataset")
MAX_CHOICES = 16
MAX_TRIALS = 100
# Plans that cannot be placed cost nothing to try; this many per allowed trial end the search.
PRUNED_PER_TRIAL = 4
# TPE is asked this many times for a plan not tried yet before the search ends.
TPE_ASKS = 20
# What a finished run leaves its deployment on: the settings it started from, or its best
# trial's plan where that met every target (in one roll-out, instead of back and then apply).
END_ON_START, END_ON_BEST = "start", "best"
END_ON = (END_ON_START, END_ON_BEST)
# A trial also loads its generation and starts the load generators: its time beyond trial_s.
TRIAL_OVERHEAD_S = 60


@dataclass(frozen=True)
class Knob:
    """One setting of one placement searched: a list of values, or a numeric range."""

    triton_name: str
    field: str
    values: tuple[Any, ...] = ()
    low: float | None = None
    high: float | None = None
    step: float | None = None

    @property
    def name(self) -> str:
        return f"{self.triton_name}.{self.field}"

    def points(self) -> list[Any]:
        """Every value the knob may take (a range, by its step)."""
        if self.values:
            return list(self.values)
        count = int(math.floor((self.high - self.low) / self.step + 1e-9)) + 1
        kind = KNOBS[self.field]
        return [kind(round(self.low + i * self.step, 6)) for i in range(count)]


def knobs_of(space: dict[str, dict[str, Any]]) -> list[Knob]:
    """The checked space's knobs, in a stable order."""
    knobs = []
    for triton_name in sorted(space):
        for field in sorted(space[triton_name]):
            value = space[triton_name][field]
            if isinstance(value, dict):
                knobs.append(Knob(triton_name, field, low=value["low"], high=value["high"], step=value["step"]))
            else:
                knobs.append(Knob(triton_name, field, values=tuple(value)))
    return knobs


def grid_size(knobs: list[Knob]) -> int:
    return math.prod(len(knob.points()) for knob in knobs)


def check(spec: dict[str, Any], *, placements: dict[str, str], aliases: dict[str, str]) -> dict[str, Any]:
    """The run's spec (types already checked) against the deployment, every
    broken rule at once by field, defaults filled in. ``placements`` maps each
    placement's triton name to its model's kind; ``aliases`` each of the
    deployment's gateway aliases to the triton name it serves."""
    errors: dict[str, str] = {}
    mix = []
    seen: set[str] = set()
    for i, entry in enumerate(spec.get("mix") or []):
        where = f"mix[{i}]"
        alias = entry["model"]
        if alias not in aliases:
            known = ", ".join(sorted(aliases)) or "none: add one on the gateway page"
            errors[f"{where}.model"] = f"no gateway alias {alias!r} points at this deployment (its aliases: {known})"
            continue
        if alias in seen:
            errors[f"{where}.model"] = f"{alias} is in the mix twice"
            continue
        seen.add(alias)
        kind = placements[aliases[alias]]
        targets = dict(entry.get("targets") or {})
        if not targets:
            errors[f"{where}.targets"] = f"give {a_target(kind)}: a trial is scored by the requests that meet it"
        for name in targets:
            if name not in TARGETS.get(kind, ()):
                errors[f"{where}.targets.{name}"] = f"not a target of {kind} models ({', '.join(TARGETS[kind])})"
        shape = {name: entry[name] for name in SHAPE if entry.get(name) is not None}
        try:
            # Each alias's load is a load test's workload: a Poisson rate held for the trial.
            workload = workloads.check(kind, {**shape, "mode": "rate", "levels": [entry["rate"]],
                                              "duration_s": spec["trial_s"], "seed": spec.get("seed", 0)})  # fmt: skip
        except ValidationFailed as failed:
            errors.update({f"{where}.{name}": " ".join(rules) for name, rules in failed.errors.items()})
            continue
        mix.append({"model": alias, "rate": entry["rate"], "triton_name": aliases[alias], "kind": kind,
                    "targets": targets, "workload": workload})  # fmt: skip
    if not spec.get("mix"):
        errors["mix"] = "at least one alias and its request rate"
    space = spec.get("space") or {}
    for triton_name, fields in space.items():
        if triton_name not in placements:
            errors[f"space.{triton_name}"] = f"the deployment has no model {triton_name!r} ({', '.join(placements)})"
            continue
        for field, value in fields.items():
            where = f"space.{triton_name}.{field}"
            if field not in KNOBS:
                errors[where] = f"not a searchable setting (one of {', '.join(KNOBS)})"
            elif isinstance(value, dict):
                if KNOBS[field] is list or field == "engine_build":
                    errors[where] = "give a list of values"
                elif set(value) != {"low", "high", "step"} or not all(_of_type(v, float) for v in value.values()):
                    errors[where] = "a range is {low, high, step}, numbers"
                elif value["step"] <= 0:
                    errors[where] = "step must be above 0"
                elif value["high"] <= value["low"]:
                    errors[where] = "high must be above low"
                elif (value["high"] - value["low"]) / value["step"] + 1 > MAX_CHOICES:
                    errors[where] = f"at most {MAX_CHOICES} values: widen the step"
            elif not isinstance(value, list):
                errors[where] = "a list of values, or a range {low, high, step}"
            elif not 1 <= len(value) <= MAX_CHOICES:
                errors[where] = f"from 1 to {MAX_CHOICES} values"
            elif any(not _of_type(v, KNOBS[field]) for v in value):
                errors[where] = f"values of type {KNOBS[field].__name__}"
            elif len({repr(v) for v in value}) != len(value):
                errors[where] = "each value once"
    if not errors and space and grid_size(knobs_of(space)) < 2:
        errors["space"] = "nothing to search: give some knob at least two values"
    elif not space:
        errors["space"] = "at least one model's setting and the values to try"
    if errors:
        raise ValidationFailed(errors)
    trial_s, budget_s = spec["trial_s"], spec["budget_s"]
    if budget_s < trial_s + TRIAL_OVERHEAD_S:
        raise ValidationFailed({"budget_s": f"at least one trial: trial_s + {TRIAL_OVERHEAD_S} s"})
    size = grid_size(knobs_of(space))
    max_trials = spec.get("max_trials") or min(size, MAX_TRIALS)
    return {
        "mix": mix,
        "space": space,
        "trial_s": trial_s,
        "budget_s": budget_s,
        "max_trials": max_trials,
        "search": "grid" if size <= max_trials else "tpe",
        "grid_size": size,
        "seed": spec.get("seed", 0),
        "end_on": spec.get("end_on") or END_ON_START,
    }


def a_target(kind: str) -> str:
    return "a TTFT, inter-token or latency p99 target" if kind == ModelKind.LLM else "a latency p99 target"


def _of_type(value: Any, kind: type) -> bool:
    if kind is list:
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool)


def plan_of(start_plan: list[dict[str, Any]], params: dict[str, Any]) -> list[dict[str, Any]]:
    """The starting placements with the trial's values set (``<triton name>.<field>``)."""
    plan = [dict(item) for item in start_plan]
    by_name = {item["triton_name"]: item for item in plan}
    for name, value in params.items():
        triton_name, field = name.rsplit(".", 1)
        by_name[triton_name][field] = value
    return plan


def differences(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a plan changes against another: one row per model and setting."""
    old = {item["triton_name"]: item for item in before}
    rows = []
    for item in after:
        for field in KNOBS:
            was = old.get(item["triton_name"], {}).get(field)
            if item.get(field) != was:
                rows.append({"model": item["triton_name"], "field": field, "from": was, "to": item.get(field)})
    return rows


# --- scoring ---------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation, as numpy's default."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def score(entry: dict[str, Any], records: list[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    """One alias's figures in a trial: its offered and served rate, each target's
    p99 against its target, and goodput: requests/s that met every target and
    did not fail."""
    served = [r for r in records if not r.get("error")]
    good = 0
    for record in served:
        if all((record.get(RECORD_FIELD[name]) or 0) <= limit for name, limit in entry["targets"].items()):
            good += 1
    p99 = {name: percentile([r[RECORD_FIELD[name]] for r in served if r.get(RECORD_FIELD[name]) is not None], 99)
           for name in entry["targets"]}  # fmt: skip
    met = bool(served) and all(value is not None and value <= entry["targets"][name] for name, value in p99.items())
    return {
        "rate": entry["rate"],
        "requests": len(records),
        "errors": len(records) - len(served),
        "throughput": round(len(served) / duration_s, 3) if duration_s else 0.0,
        "good": good,
        "goodput": round(good / duration_s, 3) if duration_s else 0.0,
        "p99": {name: None if value is None else round(value, 3) for name, value in p99.items()},
        "targets": entry["targets"],
        "met": met,
    }


def met(trial: Any) -> bool:
    """Whether ``trial`` (a measured one) met every alias's targets."""
    return trial is not None and bool(trial.figures) and all(f.get("met") for f in trial.figures.values())


def best(trials: list[Any]) -> Any | None:
    """The measured trial with the most goodput; of equals, the one holding the
    least GPU memory, then the earliest."""
    measured = [t for t in trials if t.goodput is not None]
    return min(measured, key=lambda t: (-round(t.goodput, 6), t.gpu_share, t.number), default=None)


# --- the search ------------------------------------------------------------------


def next_params(spec: dict[str, Any], tried: list[tuple[dict[str, Any], str, float | None]]) -> dict[str, Any] | None:
    """The values of the next trial, given those tried so far (values, trial
    status, goodput); None when the search is over: the grid is exhausted,
    ``max_trials`` plans were loaded (a pruned plan costs nothing, so it does
    not count, up to PRUNED_PER_TRIAL of them per trial), or TPE offers only
    plans already tried."""
    pruned = sum(status == "pruned" for _, status, _ in tried)
    if len(tried) - pruned >= spec["max_trials"] or pruned >= PRUNED_PER_TRIAL * spec["max_trials"]:
        return None
    knobs = knobs_of(spec["space"])
    seen = {_key(params) for params, _, _ in tried}
    if spec["search"] == "grid":
        for values in itertools.product(*(knob.points() for knob in knobs)):
            params = {knob.name: value for knob, value in zip(knobs, values, strict=True)}
            if _key(params) not in seen:
                return params
        return None
    # TPE may offer a plan again (its choices are few); a plan is measured once.
    for attempt in range(TPE_ASKS):
        params = _tpe(knobs, tried, seed=spec["seed"] + attempt * 7919)
        if _key(params) not in seen:
            return params
    return None


def _key(params: dict[str, Any]) -> str:
    return repr(sorted(params.items()))


def _tpe(knobs: list[Knob], tried: list[tuple[dict[str, Any], str, float | None]], *, seed: int) -> dict[str, Any]:
    """optuna's TPE sampler, told every earlier trial, asked for one more. Each
    knob is a choice among its points (by index: optuna's choices are plain
    scalars, a list of batch sizes is not); a range is ordered, so it is an
    integer index TPE can step along."""
    import optuna  # the worker's: the web tier never searches

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    distributions: dict[str, optuna.distributions.BaseDistribution] = {}
    for knob in knobs:
        count = len(knob.points())
        if knob.values:
            distributions[knob.name] = optuna.distributions.CategoricalDistribution(list(range(count)))
        else:
            distributions[knob.name] = optuna.distributions.IntDistribution(0, count - 1)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed + len(tried)))
    states = {"measured": optuna.trial.TrialState.COMPLETE, "pruned": optuna.trial.TrialState.PRUNED}
    for params, status, goodput in tried:
        state = states.get(status, optuna.trial.TrialState.FAIL)
        indexes = {k.name: _index(k, params[k.name]) for k in knobs if k.name in params}
        if len(indexes) != len(knobs) or None in indexes.values():
            continue  # a trial of an earlier space: it says nothing about this one
        study.add_trial(
            optuna.trial.create_trial(
                params=indexes,
                distributions=distributions,
                state=state,
                value=goodput if state == optuna.trial.TrialState.COMPLETE else None,
            )
        )
    asked = study.ask(distributions)
    return {knob.name: knob.points()[asked.params[knob.name]] for knob in knobs}


def _index(knob: Knob, value: Any) -> int | None:
    points = knob.points()
    return points.index(value) if value in points else None
