"""Runs tuning runs on the deployment's host: trial after trial, each a new
generation rolled out and then loaded with the mix (one AIPerf per alias,
started together, each at its alias's Poisson rate through the gateway),
scored by goodput (loadtests.tuning), until the search, its trial bound or its
time budget ends, or a cancel. The deployment gets its starting settings back
however the run ends (loadtests.tuning_services.tuning_finish). After a worker
died, what it left on this host is stopped (reconcile_runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from deployments import states
from deployments.models import Deployment, DeploymentRevision, DeploymentStatus
from loadtests import tuning
from loadtests import tuning_services as services
from loadtests.models import LoadTest, RunStatus, TrialStatus, TuningRun, TuningTrial
from workers import processes
from workers.jobs import JobFailed, run_job, source
from workers.loadtest import aiperf
from workers.loadtest.aiperf import GRACE_S, Step, config_for, last_error
from workers.loadtest.results import records_of
from workers.loadtest.runs import NO_KEY, STARTUP_ALLOWANCE_S, Stop, reconcile

# A trial's generation gets this long to load on every replica (models reload one by one).
ROLL_LIMIT_S = 900


def run_folder(run_id: int) -> Path:
    """Where a run's trials keep AIPerf's configuration, output and log on this host."""
    return Path(settings.GANTRY_DATA_DIR) / "tuning" / str(run_id)


def reconcile_runs() -> None:
    """Stop what a dead worker left on this host: each tuning run's load
    generators; the run fails (its deployment gets its starting settings back),
    keeping the trials it measured."""
    reconcile(services.TUNING_RUN, run_folder, services.tuning_finish, stopped="its load generators were stopped")


def run(run_id: int, key: str) -> None:
    """Run tuning run ``run_id`` (a task delivered twice finds it no longer queued)."""
    run_job(
        "tuning run",
        lambda: _claim_and_run(run_id, key),
        fail=lambda reason, *, status, details: _finish(run_id, status or RunStatus.FAILED, reason),
    )


def _finish(run_id: int, status: str, message: str) -> None:
    """End the run once no generation is rolling out (a roll cannot be
    changed midway): tuning_finish then puts the starting settings back."""
    began = time.monotonic()
    while time.monotonic() - began < ROLL_LIMIT_S:
        run = TuningRun.objects.filter(pk=run_id).first()
        rolling = run is not None and run.deployment_id is not None and Deployment.objects.filter(
            pk=run.deployment_id, status=DeploymentStatus.UPDATING).exists()  # fmt: skip
        if not rolling:
            break
        services.tuning_report(run_id=run_id, progress={"state": "waiting for the roll to end", "ending": status})
        time.sleep(1.0)
    services.tuning_finish(run_id=run_id, status=status, message=message, source=source())


def _claim_and_run(run_id: int, key: str) -> None:
    claimed = services.tuning_claim(run_id=run_id, source=source())
    if claimed is not None:
        _run(claimed, key)


def _run(run: TuningRun, key: str) -> None:
    aiperf.aiperf_version()  # installed, or the run fails saying how to install it
    spec = run.spec
    ends_at = time.monotonic() + spec["budget_s"]
    if not key:
        raise JobFailed(NO_KEY)
    folder = run_folder(run.pk)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        while True:
            trials = list(TuningTrial.objects.filter(run=run).order_by("number"))
            tried = [(t.params, t.status, t.goodput) for t in trials]
            _report(run, {"state": "choosing", "trials": len(trials)})
            left = ends_at - time.monotonic()
            if left < spec["trial_s"] + tuning.TRIAL_OVERHEAD_S:
                _done(run, f"its {spec['budget_s']} s budget is spent")
                return
            params = _baseline(run) if not trials else tuning.next_params(spec, tried)
            if params is None:
                searched = "every plan of the grid was tried" if spec["search"] == "grid" else "its trial bound"
                _done(run, searched if spec["search"] == "grid" else f"it reached {searched}")
                return
            _trial(run, len(trials), params, key=key, folder=folder / str(len(trials)))
    except Stop as stop:
        _finish(run.pk, stop.status, stop.reason)


def _baseline(run: TuningRun) -> dict[str, Any]:
    """Trial 0: the starting plan's own values of the knobs, measured under the same mix."""
    start = {item["triton_name"]: item for item in run.start_plan}
    return {knob.name: start[knob.triton_name].get(knob.field) for knob in tuning.knobs_of(run.spec["space"])}


def _done(run: TuningRun, why: str) -> None:
    trials = list(TuningTrial.objects.filter(run=run))
    counts = {status: sum(t.status == status for t in trials) for status in TrialStatus.values}
    best = tuning.best(trials)
    said = f"best: trial {best.number}, {best.goodput:g} good requests/s" if best else "no trial was measured"
    baseline = next((t for t in trials if t.number == 0 and t.goodput is not None), None)
    if best is not None and baseline is not None:
        said += f" (the starting plan: {baseline.goodput:g})"
    message = (
        f"searched until {why}: {len(trials)} trial(s), {counts['measured']} measured, {counts['pruned']} pruned, "
        f"{counts['failed']} failed; {said}"
    )
    _finish(run.pk, RunStatus.SUCCEEDED, message)


def _report(run: TuningRun, progress: dict[str, Any]) -> None:
    status = services.tuning_report(run_id=run.pk, progress=progress)
    if status == RunStatus.CANCELLING:
        raise Stop(RunStatus.CANCELLED, "cancelled; the trials measured before are kept")


def _trial(run: TuningRun, number: int, params: dict[str, Any], *, key: str, folder: Path) -> None:
    _report(run, {"state": "loading", "trial": number, "params": params})
    trial = services.trial_start(run_id=run.pk, number=number, params=params)
    if trial.status != TrialStatus.RUNNING:
        return  # pruned: the plan cannot be placed
    refusal = _rolled(run, trial)
    if refusal:
        services.trial_end(trial_id=trial.pk, status=TrialStatus.FAILED, reason=refusal)
        return
    figures, problem = _measure(run, trial, key=key, folder=folder)
    if problem:
        services.trial_end(trial_id=trial.pk, status=TrialStatus.FAILED, reason=problem, figures=figures)
        return
    goodput = round(sum(f["goodput"] for f in figures.values()), 3)
    services.trial_end(trial_id=trial.pk, status=TrialStatus.MEASURED, figures=figures, goodput=goodput)


def _rolled(run: TuningRun, trial: TuningTrial) -> str:
    """Wait until every replica serves the trial's generation; why not ('' when
    it does): the roll failed and went back (a model did not load)."""
    began = time.monotonic()
    while True:
        deployment = Deployment.objects.get(pk=run.deployment_id)
        if deployment.generation != trial.generation:
            failed = DeploymentRevision.objects.filter(deployment=deployment, generation=trial.generation).first()
            return f"generation {trial.generation} did not load: {failed.message if failed else 'rolled back'}"
        replicas = list(deployment.replica_set.filter(status__in=states.ACTIVE))
        if (
            deployment.status == DeploymentStatus.READY
            and replicas
            and all(r.generation == trial.generation and r.status == DeploymentStatus.READY for r in replicas)
        ):
            return ""
        if deployment.status in (DeploymentStatus.FAILED, DeploymentStatus.STOPPED, DeploymentStatus.STOPPING):
            raise Stop(RunStatus.FAILED, f"{deployment.name} became {deployment.status} while trial "
                        f"{trial.number} loaded")  # fmt: skip
        if time.monotonic() - began > ROLL_LIMIT_S:
            raise Stop(RunStatus.FAILED, f"generation {trial.generation} was not ready within {ROLL_LIMIT_S} s")
        _report(run, {"state": "loading", "trial": trial.number, "params": trial.params,
                      "generation": trial.generation, "elapsed_s": round(time.monotonic() - began)})  # fmt: skip
        time.sleep(1.0)


@dataclass
class _Load:
    """One alias's load generator in a trial."""

    entry: dict[str, Any]
    workdir: Path
    process: subprocess.Popen


def _measure(run: TuningRun, trial: TuningTrial, *, key: str, folder: Path) -> tuple[dict[str, Any], str]:
    """Load every alias of the mix at once for trial_s; each alias's figures
    (loadtests.tuning.score), and what went wrong ('' when nothing did)."""
    deployment = Deployment.objects.get(pk=run.deployment_id)
    paths = dict(deployment.placements.values_list("triton_name", "registered_model__path"))
    trial_s = run.spec["trial_s"]
    loads: list[_Load] = []
    env = aiperf.environment(key)
    try:
        for index, entry in enumerate(run.spec["mix"]):
            workdir = folder / entry["model"]
            workdir.mkdir(parents=True)
            # A load test's configuration, for a run that is never stored: the trial's own step.
            as_test = LoadTest(alias=entry["model"], triton_name=entry["triton_name"], kind=entry["kind"],
                               workload=entry["workload"])  # fmt: skip
            step = Step(target="gateway", level=entry["rate"], index=index, total=len(run.spec["mix"]))
            config = config_for(as_test, step, gateway_url=settings.GANTRY_GATEWAY_URL, triton_url="",
                                tokenizer=paths[entry["triton_name"]], artifacts=workdir / "artifacts")  # fmt: skip
            (workdir / "aiperf.json").write_text(json.dumps(config, indent=1))
            with (workdir / "aiperf.log").open("wb") as out:
                process = processes.start_group(aiperf.command(workdir / "aiperf.json"), env=env, cwd=workdir,
                                                stdout=out)  # fmt: skip
            loads.append(_Load(entry, workdir, process))
        _watch(run, trial, loads, limit_s=trial_s + GRACE_S + STARTUP_ALLOWANCE_S)
    finally:
        for load in loads:
            if load.process.poll() is None:
                processes.terminate_group(load.process.pid, grace_s=5.0)
            load.process.wait()
    figures: dict[str, Any] = {}
    problems = []
    for load in loads:
        records, counted = records_of(load.workdir / "artifacts" / "profile_export.jsonl")
        if not records:
            tail = (load.workdir / "aiperf.log").read_text(errors="replace").splitlines()[-40:]
            problems.append(f"{load.entry['model']}: AIPerf measured nothing (exit code {load.process.returncode}"
                            f"{': ' + last_error(tail) if last_error(tail) else ''})")  # fmt: skip
            continue
        figures[load.entry["model"]] = tuning.score(load.entry, records, trial_s) | {"counted": counted}
    return figures, "; ".join(problems)


def _watch(run: TuningRun, trial: TuningTrial, loads: list[_Load], *, limit_s: int) -> None:
    """Each second until every generator ends: report, and stop them all on a
    cancel, the deployment leaving ready, or the trial's time bound."""
    began = time.monotonic()
    while any(load.process.poll() is None for load in loads):
        time.sleep(1.0)
        elapsed = time.monotonic() - began
        stop: Stop | None = None
        try:
            _report(run, {"state": "measuring", "trial": trial.number, "params": trial.params,
                          "elapsed_s": round(elapsed), "trial_s": run.spec["trial_s"]})  # fmt: skip
        except Stop as cancelled:
            stop = cancelled
        current = Deployment.objects.filter(pk=run.deployment_id).values_list("status", flat=True).first()
        if stop is None and current != DeploymentStatus.READY:
            stop = Stop(RunStatus.FAILED, f"{run.deployment_name} left ready ({current or 'deleted'}) during "
                         f"trial {trial.number}")  # fmt: skip
        if stop is None and elapsed > limit_s:
            stop = Stop(RunStatus.FAILED, f"trial {trial.number}'s load ran past its {limit_s} s bound")
        if stop is not None:
            _stop_all(run, loads)
            raise stop


def _stop_all(run: TuningRun, loads: list[_Load], *, grace_s: float = 20.0) -> None:
    """SIGINT every generator at once (AIPerf then ends its requests), still
    reporting each second, so the host agent never takes the run for one whose
    worker died; what is left after ``grace_s`` is killed."""
    for load in loads:
        if load.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(load.process.pid, signal.SIGINT)
    until = time.monotonic() + grace_s
    while any(load.process.poll() is None for load in loads) and time.monotonic() < until:
        services.tuning_report(run_id=run.pk, progress={"state": "stopping the load generators"})
        time.sleep(1.0)
    for load in loads:
        if load.process.poll() is None:
            processes.terminate_group(load.process.pid, grace_s=5.0)
