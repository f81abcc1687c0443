"""One engine build on its host: checkpoint conversion, then trtllm-build, each
step in an executor (workers.engines.executors), followed line by line.

Lines are stored and pushed in batches (``LogBatcher``) so a build printing
thousands of lines costs a few inserts and messages per second. The build row
is heartbeated while it runs; that is how a cancel request reaches the worker
and how a dead worker's build is noticed (workers.engines.reconcile,
deployments.services.builds.builds_reap). Failures go through the one job
runner (workers.jobs) and keep the log tail and a hint.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import re
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, TypeVar

from django.conf import settings

from deployments.models import BuildStatus as B
from deployments.models import EngineBuild
from deployments.services import builds
from upstream import trtllm
from upstream.checkpoints import checkpoint_files, fingerprint
from workers.engines import verify
from workers.engines.executors import RunningStep, StepContext, executor_for
from workers.jobs import JobFailed, run_job, source

T = TypeVar("T")

FLUSH_EVERY_S = 0.5
FLUSH_LINES = 200
HINT_WINDOW = 200  # lines searched for a known failure cause
TAIL_LINES = 20

HINTS: list[tuple[re.Pattern[str], str]] = [
    (
        re.compile(r"out of memory|CUDA_ERROR_OUT_OF_MEMORY|OutOfMemoryError|cudaErrorMemoryAllocation", re.I),
        "the GPU ran out of memory: lower max_batch_size, max_num_tokens or max_seq_len, "
        "raise tp_size, or stop what else uses the GPU",
    ),
    (
        re.compile(
            r"incompatible device|unsupported (SM|compute capability|GPU architecture)|"
            r"not supported on (this|the current) (GPU|device)|no kernel image is available",
            re.I,
        ),
        "this TensorRT-LLM release does not support the GPU's SM: use a builder image made for it",
    ),
    (
        re.compile(
            r"(FileNotFoundError|No such file or directory|does not appear to have a file named)"
            r".*(config\.json|\.safetensors|\.bin|tokenizer)",
            re.I,
        ),
        "checkpoint files are missing: restore the checkpoint folder and register it again",
    ),
]

log = logging.getLogger(__name__)


def hint_for(lines: list[str]) -> str:
    """The known cause of a failure, from its last log lines ('' when unknown)."""
    text = "\n".join(lines[-HINT_WINDOW:])
    for pattern, hint in HINTS:
        if pattern.search(text):
            return hint
    return ""


def work_dir(build_id: int) -> Path:
    return settings.GANTRY_DATA_DIR / "builds" / str(build_id)


def timing_cache(build: EngineBuild) -> Path:
    """One timing cache per GPU model and image: TensorRT reuses its kernel timings on rebuilds."""
    gpu = re.sub(r"[^a-z0-9]+", "-", build.gpu_name.lower()).strip("-") or "gpu"
    image = hashlib.sha256(build.image_digest.encode()).hexdigest()[:12]
    return settings.GANTRY_DATA_DIR / "timing-cache" / f"{gpu}-{image}.cache"


class LogBatcher:
    """Collects output lines and stores/pushes them a batch at a time."""

    def __init__(self, build_id: int) -> None:
        self.build_id = build_id
        self.pending: list[str] = []
        self.tail: deque[str] = deque(maxlen=HINT_WINDOW)
        self.last_flush = time.monotonic()

    def add(self, line: str) -> None:
        self.pending.append(line)
        self.tail.append(line)
        if len(self.pending) >= FLUSH_LINES:
            self.flush()

    def due(self) -> bool:
        return bool(self.pending) and time.monotonic() - self.last_flush >= FLUSH_EVERY_S

    def flush(self) -> None:
        lines, self.pending = self.pending, []
        self.last_flush = time.monotonic()
        builds.build_log_append(build_id=self.build_id, lines=lines)


def _pump(step: RunningStep, lines: queue.Queue) -> None:
    try:
        for line in step.stream():
            lines.put(line)
    finally:
        lines.put(None)


def _run_step(
    build: EngineBuild, step: RunningStep, phase: str, batcher: LogBatcher, deadline: float, engine_dir: Path
) -> int:
    """Follow one step to its end: stream its output, heartbeat the build, report
    rank progress, and stop it on a cancel request or at the time limit."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(step, lines), daemon=True).start()
    streaming = True
    last_beat = 0.0
    while True:
        try:
            line = lines.get(timeout=0.2)
            if line is None:
                streaming = False
            else:
                batcher.add(line)
        except queue.Empty:
            pass
        if batcher.due():
            batcher.flush()
        now = time.monotonic()
        if now - last_beat >= 1.0:
            last_beat = now
            shown = phase
            if phase == "building":
                done = len(list(engine_dir.glob("rank*.engine"))) if engine_dir.is_dir() else 0
                shown = f"building rank {min(done + 1, build.world_size)} of {build.world_size}"
            status = builds.build_progress(build_id=build.pk, source=source(), phase=shown)
            if status == B.CANCELLING:
                step.kill()
                raise JobFailed("cancelled", status=B.CANCELLED)
            if now > deadline:
                step.kill()
                raise JobFailed(f"stopped at the time limit of {build.time_limit_s} s")
        if not streaming:
            code = step.exit_code()
            if code is not None:
                return code
            time.sleep(0.2)


def _beating(build: EngineBuild, phase: str, work: Callable[[], T]) -> T:
    """Run ``work`` (reading or hashing many GB) while heartbeating the build, so
    a long read is not taken for a dead worker and a cancel request still lands."""
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(work)
    try:
        while True:
            try:
                return future.result(timeout=1.0)
            except FutureTimeout:
                if builds.build_progress(build_id=build.pk, source=source(), phase=phase) == B.CANCELLING:
                    raise JobFailed("cancelled", status=B.CANCELLED) from None
    finally:
        pool.shutdown(wait=False)  # a cancelled read finishes on its own; nobody waits for it


def _prepare(build: EngineBuild, batcher: LogBatcher) -> None:
    """Check the GPUs, and that the checkpoint is whole and unchanged since it was registered."""
    batcher.add(verify.verify_gpus(build))
    checkpoint = build.model.folder
    files = checkpoint_files(checkpoint, settings.GANTRY_MODEL_ROOTS)
    if files is None:
        raise JobFailed(f"{checkpoint}/config.json is missing, or the folder is outside GANTRY_MODEL_ROOTS")
    batcher.add(f"[gantry] checking {len(files)} checkpoint files in {checkpoint}")
    batcher.flush()
    if _beating(build, "preparing the checkpoint", lambda: fingerprint(checkpoint, files)) != build.model.fingerprint:
        raise JobFailed(f"the checkpoint in {checkpoint} changed since it was registered: register it again")
    batcher.add("[gantry] checkpoint fingerprint matches the registered one")


def run_build(build_id: int) -> None:
    """Run a pending build to its end. Safe to deliver twice: only the delivery
    that claims the pending row builds; the others return at once."""
    build = EngineBuild.objects.select_related("model", "host").filter(pk=build_id).first()
    if build is None or build.status != B.PENDING:
        return
    root = work_dir(build_id)
    claimed = builds.build_claim(build_id=build_id, source=source(), output_dir=str(root / "engine"))
    if claimed is None:
        return
    batcher = LogBatcher(build_id)
    run_job("build", lambda: _build(claimed, batcher), fail=_failer(build_id, batcher))


def _failer(build_id: int, batcher: LogBatcher):  # noqa: ANN202 - a workers.jobs.Fail
    """A failed build keeps its last output lines in its message, and a hint when the cause is known."""

    def fail(reason: str, *, status: str | None, details: dict[str, Any]) -> None:
        if batcher.pending:
            batcher.flush()
        to = status or B.FAILED
        tail = list(batcher.tail)
        hint = hint_for(tail) if to == B.FAILED else ""
        message = reason + ("\n" + "\n".join(tail[-TAIL_LINES:]) if to == B.FAILED and tail else "")
        builds.build_finish(
            build_id=build_id, to=to, source=source(), message=message, exit_code=details.get("exit_code"), hint=hint,
            runtime_handle="",
        )  # fmt: skip

    return fail


def _build(build: EngineBuild, batcher: LogBatcher) -> None:
    build_id = build.pk
    root = work_dir(build_id)
    converted, engine_dir = root / "converted", root / "engine"
    cache = timing_cache(build)
    deadline = time.monotonic() + build.time_limit_s
    executor = executor_for(build)
    release = trtllm.release_for(build.trtllm_version)
    if release is None:
        raise JobFailed(f"TensorRT-LLM {build.trtllm_version} is not in Gantry's version table")
    for folder in (converted, engine_dir):
        if folder.exists():
            # A leftover of an earlier attempt at this build id must not count as its output.
            shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    cache.parent.mkdir(parents=True, exist_ok=True)
    _prepare(build, batcher)
    paths = trtllm.BuildPaths(checkpoint=build.model.folder, converted=converted, engine=engine_dir, timing_cache=cache)
    steps = trtllm.compose(build.spec, release, paths, executor.toolchain(release), build.model.architecture)
    for index, step in enumerate(steps):
        batcher.add(f"[gantry] {step.phase}: {' '.join(step.argv)}")
        batcher.flush()
        builds.build_progress(build_id=build_id, source=source(), phase=step.phase)
        ctx = StepContext(
            build_id=build_id,
            index=index,
            image=build.builder_image,
            gpu_ids=tuple(build.gpu_ids),
            read_only=(str(paths.checkpoint),),
            read_write=(str(root), str(cache.parent)),
        )
        running = executor.start(step.argv, ctx)
        builds.build_progress(build_id=build_id, source=source(), runtime_handle=running.handle)
        try:
            code = _run_step(build, running, step.phase, batcher, deadline, engine_dir)
        finally:
            running.remove()
        if code != 0:
            raise JobFailed(f"{step.phase} failed with exit code {code}", exit_code=code)
    builds.build_progress(build_id=build_id, source=source(), phase="verifying")
    recorded = _beating(build, "verifying", lambda: verify.verify_engine(build, engine_dir))
    batcher.add(f"[gantry] engine verified: {len(recorded['artifacts'])} files")
    batcher.flush()
    builds.build_finish(
        build_id=build_id,
        to=B.SUCCEEDED,
        source=source(),
        message=f"engine ready in {engine_dir}",
        phase="done",
        exit_code=0,
        runtime_handle="",
        **recorded,
    )


def forget(build_id: int) -> None:
    """Remove what a deleted build left on this host (its work folder and engine)."""
    if EngineBuild.objects.filter(pk=build_id).exists():
        return  # not deleted after all (a stale message): keep its files
    root = work_dir(build_id)
    if root.exists():
        shutil.rmtree(root)
        log.info("removed %s of deleted build %s", root, build_id)
