"""Engine builds on a GPU host: checkpoint conversion, then trtllm-build, in the
builder image (docker executor) or with the host's own tensorrt_llm (native).

Both executors stream output line by line; lines are stored and pushed in
batches (``LogBatcher``) so a build printing thousands of lines costs a few
inserts and messages per second. The build row is heartbeated while it runs;
that is how a cancel request reaches the worker and how a dead worker's build
is noticed (``reconcile_builds``, ``deployments.builds.builds_reap``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol, TypeVar

from django.conf import settings
from django.utils import timezone

from deployments import builds, trtllm
from deployments.checkpoints import fingerprint
from deployments.errors import GantryError, PermanentError
from deployments.models import BuildExecutor, BuildStatus, EngineBuild
from workers import nvml
from workers.runtimes import docker as docker_engine

log = logging.getLogger(__name__)
B = BuildStatus
T = TypeVar("T")

FLUSH_EVERY_S = 0.5
FLUSH_LINES = 200
HINT_WINDOW = 200  # lines searched for a known failure cause
TAIL_LINES = 20
# A running build on this host whose worker has not heartbeated it for this long
# belongs to a worker that died: the agent stops what it left and fails it.
ORPHAN_AFTER_S = 20

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


def hint_for(lines: list[str]) -> str:
    """The known cause of a failure, from its last log lines ('' when unknown)."""
    text = "\n".join(lines[-HINT_WINDOW:])
    for pattern, hint in HINTS:
        if pattern.search(text):
            return hint
    return ""


def source() -> str:
    return f"worker:{settings.GANTRY_HOST_NAME}"


def work_dir(build_id: int) -> Path:
    return settings.GANTRY_DATA_DIR / "builds" / str(build_id)


def timing_cache(build: EngineBuild) -> Path:
    """One timing cache per GPU model and image: TensorRT reuses its kernel timings on rebuilds."""
    gpu = re.sub(r"[^a-z0-9]+", "-", build.gpu_name.lower()).strip("-") or "gpu"
    image = hashlib.sha256(build.image_digest.encode()).hexdigest()[:12]
    return settings.GANTRY_DATA_DIR / "timing-cache" / f"{gpu}-{image}.cache"


# --- executors ------------------------------------------------------------------


class RunningStep(Protocol):
    handle: str

    def stream(self) -> Iterator[str]: ...

    def exit_code(self) -> int | None: ...

    def kill(self) -> None: ...

    def remove(self) -> None: ...


@dataclass(frozen=True)
class StepContext:
    build_id: int
    index: int
    image: str
    gpu_ids: tuple[int, ...]
    read_only: tuple[str, ...]
    read_write: tuple[str, ...]


class DockerExecutor:
    """Each step is a container of the builder image."""

    def toolchain(self, release: trtllm.Release) -> trtllm.Toolchain:
        return trtllm.Toolchain(python=["python3"], trtllm_build=["trtllm-build"], examples_dir=release.examples_dir)

    def start(self, argv: list[str], ctx: StepContext) -> RunningStep:
        spec = docker_engine.BuildContainerSpec(
            build_id=ctx.build_id,
            step=ctx.index,
            image=ctx.image,
            argv=argv,
            gpu_ids=ctx.gpu_ids,
            read_only=ctx.read_only,
            read_write=ctx.read_write,
            ulimits=tuple(settings.GANTRY_DOCKER_ULIMITS),
            env={"GANTRY_BUILD_ID": str(ctx.build_id), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        )
        return docker_engine.BuildContainer(spec, settings.GANTRY_HOST_NAME)


class ProcessStep:
    """A step run as a host process in its own process group."""

    def __init__(self, argv: list[str], ctx: StepContext) -> None:
        env = {
            **os.environ,
            "GANTRY_BUILD_ID": str(ctx.build_id),
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, ctx.gpu_ids)),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        try:
            self._process = subprocess.Popen(  # noqa: S603 - argv composed by deployments.trtllm only
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ctx.read_write[0],
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            raise PermanentError(f"could not start {argv[0]}: {exc}") from exc
        self.handle = f"pid:{self._process.pid}"

    def stream(self) -> Iterator[str]:
        assert self._process.stdout is not None
        for raw in self._process.stdout:
            yield raw.decode("utf-8", errors="replace").rstrip("\r\n")

    def exit_code(self) -> int | None:
        return self._process.poll()

    def kill(self) -> None:
        kill_process_group(self._process.pid)
        self._process.wait(timeout=30)

    def remove(self) -> None:
        pass


class NativeExecutor:
    """Each step is a process of the host python that has tensorrt_llm (GANTRY_TRTLLM_PYTHON)."""

    def toolchain(self, release: trtllm.Release) -> trtllm.Toolchain:
        python = settings.GANTRY_TRTLLM_PYTHON
        return trtllm.Toolchain(
            python=[python],
            trtllm_build=[python, "-m", "tensorrt_llm.commands.build"],
            examples_dir=settings.GANTRY_TRTLLM_EXAMPLES_DIR or release.examples_dir,
        )

    def start(self, argv: list[str], ctx: StepContext) -> RunningStep:
        return ProcessStep(argv, ctx)


def kill_process_group(pid: int, grace_s: float = 10) -> None:
    """SIGTERM the group led by ``pid``, SIGKILL what is left after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def executor_for(build: EngineBuild) -> DockerExecutor | NativeExecutor:
    return NativeExecutor() if build.executor == BuildExecutor.NATIVE else DockerExecutor()


def native_version() -> str:
    """The tensorrt_llm version of GANTRY_TRTLLM_PYTHON ('' when none is configured or importable)."""
    if not settings.GANTRY_TRTLLM_PYTHON:
        return ""
    probe = "import importlib.metadata as m; print(m.version('tensorrt_llm'))"
    try:
        done = subprocess.run(  # noqa: S603 - a fixed probe
            [settings.GANTRY_TRTLLM_PYTHON, "-c", probe], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def builders_report() -> dict:
    """What this host can build with, for the heartbeat."""
    return {
        "images": docker_engine.image_digests(sorted(settings.GANTRY_BUILDER_IMAGES)),
        "native": native_version(),
    }


# --- one build ------------------------------------------------------------------


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


class StepEnded(GantryError):
    def __init__(self, status: str, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.exit_code = status, message, exit_code


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
                raise StepEnded(B.CANCELLED, "cancelled")
            if now > deadline:
                step.kill()
                raise StepEnded(B.FAILED, f"stopped at the time limit of {build.time_limit_s} s")
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
                    raise StepEnded(B.CANCELLED, "cancelled") from None
    finally:
        pool.shutdown(wait=False)  # a cancelled read finishes on its own; nobody waits for it


def _check_gpus(build: EngineBuild, batcher: LogBatcher) -> None:
    """The GPUs the build runs on are the model and SM it records (an engine is
    only valid on the architecture it was built on)."""
    found = {gpu.index: gpu for gpu in nvml.read_inventory().gpus}
    for index in build.gpu_ids:
        gpu = found.get(index)
        if gpu is None or (gpu.name, gpu.compute_capability) != (build.gpu_name, build.compute_capability):
            seen = f"{gpu.name} (SM {gpu.compute_capability})" if gpu else "missing"
            raise StepEnded(
                B.FAILED,
                f"GPU {index} is {seen}; the build was requested for {build.gpu_name} (SM {build.compute_capability})",
            )
    batcher.add(f"[gantry] building on GPU {', '.join(map(str, build.gpu_ids))}: {build.gpu_name}")


def _prepare(build: EngineBuild, batcher: LogBatcher) -> None:
    """Check the GPUs, and that the checkpoint is whole and unchanged since it was registered."""
    _check_gpus(build, batcher)
    checkpoint = Path(build.model.path)
    if not (checkpoint / "config.json").is_file():
        raise StepEnded(B.FAILED, f"{checkpoint}/config.json is missing")
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file() and not p.name.startswith("."))
    batcher.add(f"[gantry] checking {len(files)} checkpoint files in {checkpoint}")
    batcher.flush()
    if _beating(build, "preparing the checkpoint", lambda: fingerprint(checkpoint, files)) != build.model.fingerprint:
        raise StepEnded(B.FAILED, f"the checkpoint in {checkpoint} changed since it was registered: register it again")
    batcher.add("[gantry] checkpoint fingerprint matches the registered one")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def verify_engine(build: EngineBuild, engine_dir: Path) -> dict:
    """Read what trtllm-build wrote and check it against the request; returns the
    fields to record, or raises StepEnded naming the mismatch."""
    try:
        config = json.loads((engine_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise StepEnded(B.FAILED, f"the engine's config.json is missing or unreadable: {exc}") from exc
    pretrained = config.get("pretrained_config") or {}
    mapping = pretrained.get("mapping") or {}
    build_config = config.get("build_config") or {}
    plugin_config = build_config.get("plugin_config") or {}
    spec = build.spec
    problems = []
    version = str(config.get("version", ""))
    if version != build.trtllm_version:
        problems.append(f"TensorRT-LLM version {version or '(none)'} instead of {build.trtllm_version}")
    for name, want in (("tp_size", build.tp_size), ("pp_size", build.pp_size)):
        if mapping.get(name, 1) != want:
            problems.append(f"{name} {mapping.get(name)} instead of {want}")
    for name in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"):
        if build_config.get(name) != spec[name]:
            problems.append(f"{name} {build_config.get(name)} instead of {spec[name]}")
    engines = sorted(engine_dir.glob("rank*.engine"))
    if len(engines) != build.world_size:
        problems.append(f"{len(engines)} rank engines instead of {build.world_size}")
    if problems:
        raise StepEnded(B.FAILED, "the engine does not match the request: " + "; ".join(problems))
    artifacts = [
        {"name": path.name, "size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(engine_dir.iterdir())
        if path.is_file()
    ]
    return {
        "artifacts": artifacts,
        "build_config": {k: v for k, v in build_config.items() if k != "plugin_config"},
        "plugin_config": plugin_config,
        "engine_config": config,
    }


def run_build(build_id: int) -> None:
    """Run a pending build to its end. Safe to deliver twice: only the delivery
    that claims the pending row builds; the others return at once."""
    build = EngineBuild.objects.select_related("model", "host").filter(pk=build_id).first()
    if build is None or build.status != B.PENDING:
        return
    root = work_dir(build_id)
    converted, engine_dir = root / "converted", root / "engine"
    cache = timing_cache(build)
    claimed = builds.build_claim(build_id=build_id, source=source(), output_dir=str(engine_dir))
    if claimed is None:
        return
    build = claimed
    batcher = LogBatcher(build_id)
    deadline = time.monotonic() + build.time_limit_s
    executor = executor_for(build)
    release = trtllm.release_for(build.trtllm_version)
    try:
        if release is None:
            raise StepEnded(B.FAILED, f"TensorRT-LLM {build.trtllm_version} is not in Gantry's version table")
        for folder in (converted, engine_dir):
            if folder.exists():
                # A leftover of an earlier attempt at this build id must not count as its output.
                subprocess.run(["rm", "-rf", str(folder)], check=False)  # noqa: S603, S607
            folder.mkdir(parents=True)
        cache.parent.mkdir(parents=True, exist_ok=True)
        _prepare(build, batcher)
        paths = trtllm.BuildPaths(
            checkpoint=Path(build.model.path), converted=converted, engine=engine_dir, timing_cache=cache
        )
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
                raise StepEnded(B.FAILED, f"{step.phase} failed with exit code {code}", exit_code=code)
        builds.build_progress(build_id=build_id, source=source(), phase="verifying")
        recorded = _beating(build, "verifying", lambda: verify_engine(build, engine_dir))
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
    except StepEnded as ended:
        if batcher.pending:
            batcher.flush()
        tail = list(batcher.tail)
        hint = hint_for(tail) if ended.status == B.FAILED else ""
        message = ended.message + ("\n" + "\n".join(tail[-TAIL_LINES:]) if ended.status == B.FAILED and tail else "")
        builds.build_finish(
            build_id=build_id, to=ended.status, source=source(), message=message, exit_code=ended.exit_code, hint=hint,
            runtime_handle="",
        )  # fmt: skip
    except GantryError as exc:
        if batcher.pending:
            batcher.flush()
        builds.build_finish(build_id=build_id, to=B.FAILED, source=source(), message=str(exc), runtime_handle="")


# --- after a worker died ------------------------------------------------------------


def _process_of_build(handle: str, build_id: int) -> int | None:
    """The pid in ``handle`` if that process still runs this build (not a reused pid)."""
    if not handle.startswith("pid:"):
        return None
    pid = int(handle[4:])
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return pid if f"GANTRY_BUILD_ID={build_id}".encode() in environ else None


def reconcile_builds() -> None:
    """Stop what dead workers left behind on this host: builds still marked running
    whose heartbeat stopped are failed, and their containers or processes are
    stopped; build containers of no running build are removed."""
    cutoff = timezone.now() - timedelta(seconds=ORPHAN_AFTER_S)
    orphans = EngineBuild.objects.filter(
        host__name=settings.GANTRY_HOST_NAME, status__in=[B.RUNNING, B.CANCELLING], heartbeat_at__lt=cutoff
    )
    for build in orphans:
        pid = _process_of_build(build.runtime_handle, build.pk)
        if pid is not None:
            kill_process_group(pid)
        builds.build_finish(
            build_id=build.pk,
            to=B.FAILED,
            source=source(),
            message="the worker running this build stopped; what it left was stopped. Request the build again.",
            runtime_handle="",
        )
    if not settings.GANTRY_BUILDER_IMAGES:
        return
    try:
        containers = docker_engine.build_containers(settings.GANTRY_HOST_NAME)
    except GantryError:
        return
    running = set(
        EngineBuild.objects.filter(pk__in=set(containers.values()), status__in=[B.RUNNING, B.CANCELLING]).values_list(
            "pk", flat=True
        )
    )
    for container_id, build_id in containers.items():
        if build_id not in running:
            log.info("removing container %s of build %s, which is not running", container_id[:12], build_id)
            docker_engine.remove_container(container_id)
