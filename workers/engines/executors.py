"""Where a build step runs: a container of the builder image (docker executor)
or a process of the host's own tensorrt_llm (native executor). Both hand back
a RunningStep that streams output lines and can be killed; and what this host
can build with, for its heartbeat."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from django.conf import settings

from common.errors import TransientError
from deployments.models import BuildExecutor, EngineBuild
from deployments.services import builds
from upstream import trtllm
from workers import processes
from workers.jobs import source
from workers.runtimes import docker as docker_engine


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
        docker_engine.ensure_image(ctx.image, _PullPhase(ctx.build_id))  # an allow-listed builder image it lacks
        return docker_engine.BuildContainer(spec, settings.GANTRY_HOST_NAME)


class _PullPhase:
    """A builder image's pull as the build's phase ("pulling image 45 %"), every
    few seconds: it is also the build's heartbeat, so a long pull is not reaped."""

    EVERY_S = 2.0

    def __init__(self, build_id: int) -> None:
        self.build_id = build_id
        self.at = 0.0

    def __call__(self, progress: docker_engine.PullProgress) -> None:
        if time.monotonic() - self.at >= self.EVERY_S:
            self.at = time.monotonic()
            share = f" {100 * progress.done // progress.total} %" if progress.total else ""
            builds.build_progress(build_id=self.build_id, source=source(), phase=f"pulling image{share}")


class ProcessStep:
    """A step run as a host process in its own process group."""

    def __init__(self, argv: list[str], ctx: StepContext) -> None:
        env = processes.child_environment(
            {
                "GANTRY_BUILD_ID": str(ctx.build_id),
                "CUDA_VISIBLE_DEVICES": ",".join(map(str, ctx.gpu_ids)),
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        self._process = processes.start_group(argv, stdout=subprocess.PIPE, cwd=ctx.read_write[0], env=env)
        self.handle = f"pid:{self._process.pid}"

    def stream(self) -> Iterator[str]:
        assert self._process.stdout is not None
        for raw in self._process.stdout:
            yield raw.decode("utf-8", errors="replace").rstrip("\r\n")

    def exit_code(self) -> int | None:
        return self._process.poll()

    def kill(self) -> None:
        processes.terminate_group(self._process.pid)
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
            # The console script pip installed beside that python.
            trtllm_bench=[str(Path(python).parent / "trtllm-bench")],
        )

    def start(self, argv: list[str], ctx: StepContext) -> RunningStep:
        return ProcessStep(argv, ctx)


def executor_for(build: EngineBuild) -> DockerExecutor | NativeExecutor:
    return NativeExecutor() if build.executor == BuildExecutor.NATIVE else DockerExecutor()


def native_version() -> str:
    """The tensorrt_llm version of GANTRY_TRTLLM_PYTHON ('' when none is configured or importable)."""
    if not settings.GANTRY_TRTLLM_PYTHON:
        return ""
    probe = "import importlib.metadata as m; print(m.version('tensorrt_llm'))"
    try:
        done = subprocess.run(  # noqa: S603 - a fixed probe
            [settings.GANTRY_TRTLLM_PYTHON, "-c", probe],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=processes.child_environment(),
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def builders_report() -> dict:
    """What this host can build with, for the heartbeat; ``docker_error`` says why
    its images could not be read (they are then not "absent", but unknown)."""
    report: dict = {"images": {}, "native": native_version()}
    try:
        report["images"] = docker_engine.image_digests(sorted(settings.GANTRY_BUILDER_IMAGES))
    except TransientError as exc:
        report["docker_error"] = str(exc)
    return report
