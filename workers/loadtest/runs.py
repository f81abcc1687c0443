"""Runs load tests on the deployment's host: one AIPerf process per step (one
load level against one target), watched each second for a cancel, the
deployment leaving ready, or the step's time bound, with Triton's metrics
sampled beside it. A run's native ceiling steps run trtllm-bench the same way
(workers.native_bench reads and writes its files). After a worker died, what
it left on this host is stopped (reconcile_runs).
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.utils import timezone

from deployments.models import Deployment, DeploymentModel, DeploymentStatus
from loadtests import services
from loadtests import workload as workloads
from loadtests.models import LoadTest, RunStatus
from loadtests.runs import RunKind
from triton_server import metrics
from triton_server.server import LOCAL
from upstream import trtllm
from workers import native_bench, nvml, processes
from workers.engines.executors import NativeExecutor
from workers.jobs import JobFailed, run_job, source
from workers.loadtest import aiperf
from workers.loadtest.aiperf import GRACE_S, Step, aiperf_version, config_for, last_error
from workers.loadtest.results import records_of, summary_of
from workers.loadtest.sampling import ServerSampler

# A running load test on this host not heartbeated for this long belongs to a worker
# that died (a live one reports every second): the agent stops what it left.
ORPHAN_AFTER_S = 20
# AIPerf starts a dozen processes and loads the tokenizer before the first request.
STARTUP_ALLOWANCE_S = 120
# A task re-sent by a joined host (after a broker restart), or sent by a control plane
# older than node restriction, carries no gateway key: only the control plane makes keys.
NO_KEY = "its task carries no gateway key (the control plane issues one with each run it sends): ask for it again"


# --- after a worker died ----------------------------------------------------------


def run_folder(run_id: int) -> Path:
    """Where a run's steps keep AIPerf's configuration, output and log on this host."""
    return Path(settings.GANTRY_DATA_DIR) / "loadtests" / str(run_id)


def reconcile_runs() -> None:
    """Stop what a dead worker left on this host: each load test's AIPerf (if it
    still runs: it has a process group of its own, so it outlives a SIGKILLed
    worker); the run fails (which revokes its gateway key), keeping the steps it
    finished."""
    reconcile(services.LOAD_TEST, run_folder, services.run_finish, stopped="its load generator was stopped")


def reconcile(kind: RunKind, folder_of: Callable[[int], Path], finish: Callable[..., Any], *, stopped: str) -> None:
    """For each run of ``kind`` still marked running on this host whose
    heartbeat stopped: the process groups working in its folder are stopped
    (AIPerf sets its process title, which hides its command line and
    environment: a process is the run's by its working directory, whether or not
    its pid was recorded before the worker died), then ``finish`` fails it."""
    cutoff = timezone.now() - dt.timedelta(seconds=ORPHAN_AFTER_S)
    orphans = kind.model.objects.filter(
        host__name=settings.GANTRY_HOST_NAME,
        status__in=[RunStatus.RUNNING, RunStatus.CANCELLING],
        heartbeat_at__lt=cutoff,
    )
    for run in orphans:
        processes.stop_groups_working_in(folder_of(run.pk))
        finish(
            run_id=run.pk,
            status=RunStatus.FAILED,
            message=f"the worker running this {kind.name} on {settings.GANTRY_HOST_NAME} stopped (killed or "
            f"restarted); {stopped}; {kind.kept} are kept",
            source=source(),
        )


# --- one run ---------------------------------------------------------------------


class Stop(Exception):
    """The run stops: ``status`` is how it ends, ``reason`` why."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def run(run_id: int, key: str) -> None:
    """Run load test ``run_id`` (a task delivered twice finds it no longer queued)."""
    run_job(
        "load test",
        lambda: _claim_and_run(run_id, key),
        fail=lambda reason, *, status, details: services.run_finish(
            run_id=run_id, status=status or RunStatus.FAILED, message=reason, source=source()
        ),
    )


def _claim_and_run(run_id: int, key: str) -> None:
    claimed = services.run_claim(run_id=run_id, source=source())
    if claimed is not None:
        _run(claimed, key)


def _run(run: LoadTest, key: str) -> None:
    version = aiperf_version()
    services.run_note_load_generator(run_id=run.pk, name="aiperf", version=version)
    deployment = Deployment.objects.get(pk=run.deployment_id)
    placement = deployment.placements.select_related("registered_model", "engine_build").get(
        triton_name=run.triton_name
    )
    plan = workloads.steps(run.workload)
    if not key:
        raise JobFailed(NO_KEY)
    workdir = run_folder(run.pk)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    # Straight to Triton: this host's replica of the deployment (the run was sent to its host).
    local = deployment.replica_set.filter(host_id=run.host_id).order_by("serial").first()
    if local is None:
        raise JobFailed(f"{deployment.name} has no replica on {settings.GANTRY_HOST_NAME} any more")
    triton = f"http://{LOCAL}:{local.http_port}"
    for index, (target, level) in enumerate(plan):
        step = Step(target=target, level=level, index=index, total=len(plan))
        try:
            if target == "native":
                _native_step(run, step, deployment=deployment, placement=placement,
                             workdir=workdir / f"{index}-{target}")  # fmt: skip
            else:
                tokenizer = str(placement.registered_model.folder)
                _step(run, step, key=key, deployment=deployment, triton_url=triton, tokenizer=tokenizer,
                      workdir=workdir / f"{index}-{target}")  # fmt: skip
        except Stop as stop:
            services.run_finish(run_id=run.pk, status=stop.status, message=stop.reason, source=source())
            return
    done = len(plan)
    services.run_finish(run_id=run.pk, status=RunStatus.SUCCEEDED,
                        message=f"{done} step(s) measured", source=source())  # fmt: skip


def _step_limit_s(workload: dict[str, Any]) -> int:
    load = workload["duration_s"] + GRACE_S if workload["duration_s"] else workloads.STEP_LIMIT_S
    return load + STARTUP_ALLOWANCE_S


def _step(
    run: LoadTest, step: Step, *, key: str, deployment: Deployment, triton_url: str, tokenizer: str, workdir: Path
) -> None:
    workdir.mkdir(parents=True)
    artifacts = workdir / "artifacts"
    config = config_for(run, step, gateway_url=settings.GANTRY_GATEWAY_URL, triton_url=triton_url,
                        tokenizer=tokenizer, artifacts=artifacts)  # fmt: skip
    config_path = workdir / "aiperf.json"
    config_path.write_text(json.dumps(config, indent=1))
    ran = _generate(run, step, aiperf.command(config_path), env=aiperf.environment(key),
                    log_path=workdir / "aiperf.log", deployment=deployment)  # fmt: skip
    stop, tail = ran.stop, ran.tail
    services.run_report(run_id=run.pk, progress={"step": step.index + 1, "steps": step.total, "target": step.target,
                                                 "level": step.level, "state": "reading results"},
                        log_tail=_tail(ran.log_path, tail))  # fmt: skip
    export_path = artifacts / "profile_export_aiperf.json"
    export = json.loads(export_path.read_text()) if export_path.exists() else None
    records, counted = records_of(artifacts / "profile_export.jsonl")
    if export is None and not records:
        if stop is not None:
            raise stop
        raise JobFailed(
            f"AIPerf ended with exit code {ran.returncode} before measuring step {step.index + 1}: "
            + (last_error(tail) or "see the run's log"),
            log_tail="\n".join(tail),
        )
    summary = summary_of(export) if export is not None else {}
    summary["counted"] = counted
    services.point_save(
        run_id=run.pk,
        target=step.target,
        level=step.level,
        complete=stop is None and export is not None and not summary.get("was_cancelled"),
        summary=summary,
        records=records,
        server=ran.sampler.summary(),
        started_at=ran.started_at,
        finished_at=timezone.now(),
    )
    if stop is not None:
        raise stop
    if counted["requests"] and counted["errors"] == counted["requests"]:
        raise JobFailed(f"every request of step {step.index + 1} failed: " + _codes(counted))


def _native_step(
    run: LoadTest, step: Step, *, deployment: Deployment, placement: DeploymentModel, workdir: Path
) -> None:
    """One level of the native ceiling: trtllm-bench on the deployment's own
    engine with the run's workload, no server in between. It runs with the
    host's TensorRT-LLM (the version that built the engine) on the placement's
    GPUs, beside the running deployment, so the GPUs must have room for it."""
    refusal = services.native_refusal(run.host, placement)
    if refusal:
        raise JobFailed(f"native ceiling: {refusal}")
    build = placement.engine_build
    release = trtllm.release_for(build.trtllm_version)
    short = native_bench.memory_refusal(nvml.read_inventory(), placement.gpu_ids, build.engine_size_bytes,
                                        build.world_size)  # fmt: skip
    if short:
        raise JobFailed(f"native ceiling at concurrency {step.level:g}: {short}")
    w = run.workload
    model = placement.registered_model
    if not w.get("dataset") and not model.vocab_size:
        raise JobFailed(f"native ceiling: {model.name}'s inspection found no vocab_size for synthetic token ids")
    workdir.mkdir(parents=True)
    dataset = workdir / "dataset.jsonl"
    native_bench.write_dataset(dataset, w, vocab_size=model.vocab_size or 0,
                               entries=w["request_count"] + w["warmup_requests"])  # fmt: skip
    report = workdir / "report.json"
    bench = trtllm.BenchRun(
        model_name=model.name, checkpoint=model.folder, engine=Path(build.output_dir),
        dataset=dataset, report=report, workspace=workdir, requests=w["request_count"],
        concurrency=int(step.level), streaming=w["streaming"], warmup=w["warmup_requests"],
        kv_cache_fraction=native_bench.KV_CACHE_FRACTION, tp_size=build.tp_size, pp_size=build.pp_size,
    )  # fmt: skip
    argv = trtllm.compose_bench(bench, release, NativeExecutor().toolchain(release))
    env = processes.child_environment(
        {
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, placement.gpu_ids)),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    ran = _generate(run, step, argv, env=env, log_path=workdir / "trtllm-bench.log", deployment=deployment)
    # trtllm-bench writes no report when interrupted: nothing of a stopped step is kept.
    if ran.stop is not None:
        raise ran.stop
    if not report.exists():
        raise JobFailed(
            f"trtllm-bench ended with exit code {ran.returncode} before writing its report (step "
            f"{step.index + 1}): " + (ran.tail[-1] if ran.tail else "see the run's log"),
            log_tail="\n".join(ran.tail),
        )
    summary = native_bench.summary_of(json.loads(report.read_text()))
    summary["counted"] = {"requests": summary.get("request_count", 0), "errors": 0, "by_code": {}}
    services.point_save(run_id=run.pk, target=step.target, level=step.level, complete=True, summary=summary,
                        records=[], server=ran.sampler.summary(), started_at=ran.started_at,
                        finished_at=timezone.now())  # fmt: skip


@dataclass
class _Ran:
    """A step's load generator, run to its end: how it ended and what was seen."""

    returncode: int | None
    stop: Stop | None
    sampler: ServerSampler
    tail: deque[str]
    log_path: Path
    started_at: dt.datetime


def _generate(
    run: LoadTest, step: Step, argv: list[str], *, env: dict[str, str], log_path: Path, deployment: Deployment
) -> _Ran:
    """Run one step's load generator (in the folder of ``log_path``, its output
    there) to its end under _watch, with Triton sampled before, during and after."""
    local = deployment.replica_set.filter(host_id=run.host_id).order_by("serial").first()
    if local is None:
        raise JobFailed(f"{deployment.name} has no replica on {settings.GANTRY_HOST_NAME} any more")
    sampler = ServerSampler(url=metrics.local_url(local.metrics_port))
    sampler.sample(force=True)
    started_at = timezone.now()
    tail: deque[str] = deque(maxlen=40)
    with log_path.open("wb") as out:
        process = processes.start_group(argv, env=env, cwd=log_path.parent, stdout=out)
        stop = _watch(run, step, process, deployment=deployment, sampler=sampler, log_path=log_path, tail=tail,
                      limit_s=_step_limit_s(run.workload))  # fmt: skip
    sampler.sample(force=True)
    return _Ran(process.returncode, stop, sampler, tail, log_path, started_at)


def _watch(
    run: LoadTest,
    step: Step,
    process: subprocess.Popen,
    *,
    deployment: Deployment,
    sampler: ServerSampler,
    log_path: Path,
    tail: deque[str],
    limit_s: int,
) -> Stop | None:
    """Watch a step's process to its end, each second: report progress, sample
    Triton, and stop it on a cancel, the deployment leaving ready, or the
    step's time bound."""
    began = time.monotonic()
    stop: Stop | None = None

    def progress(elapsed: float) -> dict[str, Any]:
        return {"step": step.index + 1, "steps": step.total, "target": step.target, "pid": process.pid,
                "level": step.level, "elapsed_s": round(elapsed), "limit_s": limit_s}  # fmt: skip

    services.run_report(run_id=run.pk, progress=progress(0))  # its pid on the run at once
    try:
        while process.poll() is None:
            time.sleep(1.0)
            sampler.sample()
            elapsed = time.monotonic() - began
            status = services.run_report(run_id=run.pk, progress=progress(elapsed), log_tail=_tail(log_path, tail))
            current = Deployment.objects.filter(pk=deployment.pk).values_list("status", flat=True).first()
            if status == RunStatus.CANCELLING:
                stop = Stop(RunStatus.CANCELLED, "cancelled; the steps finished before are kept")
            elif current != DeploymentStatus.READY:
                stop = Stop(
                    RunStatus.FAILED,
                    f"{deployment.name} left ready ({current or 'deleted'}) during step {step.index + 1} of "
                    f"{step.total}; what was measured is kept",
                )
            elif elapsed > limit_s:
                stop = Stop(RunStatus.FAILED, f"step {step.index + 1} ran past its {limit_s} s bound")
            if stop is not None:
                # SIGINT first: AIPerf then writes what it measured so far (trtllm-bench stops cleanly).
                processes.terminate_group(process.pid, grace_s=20.0, first_signal=signal.SIGINT)
                break
    finally:
        if process.poll() is None:
            processes.terminate_group(process.pid, grace_s=5.0)
        process.wait()
    return stop


def _codes(counted: dict[str, Any]) -> str:
    return ", ".join(f"{n} x {code}" for code, n in sorted(counted["by_code"].items()))


def _tail(path: Path, tail: deque[str]) -> str:
    """The log's last lines (kept across calls in ``tail``)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "\n".join(tail)
    tail.clear()
    tail.extend(line for line in text.splitlines()[-40:] if line.strip())
    return "\n".join(tail)
