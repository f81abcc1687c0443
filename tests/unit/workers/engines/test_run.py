"""One build on its host: failure hints, the GPU check before compiling."""

from __future__ import annotations

import pytest

from deployments.models import BuildStatus, EngineBuild
from deployments.services import builds
from hosts.services.hosts import GpuReport
from tests import factories
from workers import nvml
from workers.engines import run


def request(operator, **spec):  # noqa: ANN001, ANN003, ANN201
    return builds.build_request(model="llama", host="h100-host", image=factories.IMAGE, spec=spec, user=operator)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("RuntimeError: CUDA runtime error in cudaMalloc: out of memory", "ran out of memory"),
        ("[TRT] The engine plan file is generated on an incompatible device", "does not support the GPU's SM"),
        (
            "FileNotFoundError: [Errno 2] No such file or directory: '/models/x/config.json'",
            "checkpoint files are missing",
        ),
        ("Traceback: KeyError 'foo'", ""),
    ],
)
def test_known_failure_causes_get_a_hint(line, expected):
    assert (expected in run.hint_for(["building", line])) if expected else run.hint_for([line]) == ""


def test_build_on_a_gpu_other_than_requested_fails_before_compiling(llama, operator, monkeypatch, settings, tmp_path):
    settings.GANTRY_DATA_DIR = tmp_path
    build, _ = request(operator)
    a100 = GpuReport(
        index=0, uuid="GPU-x", name="NVIDIA A100-SXM4-80GB", compute_capability="8.0", memory_total_bytes=80 << 30
    )
    monkeypatch.setattr(nvml, "read_inventory", lambda: nvml.Inventory(gpus=[a100]))
    run.run_build(build.pk)
    build.refresh_from_db()
    assert build.status == BuildStatus.FAILED
    assert build.status_message.startswith(
        "GPU 0 is NVIDIA A100-SXM4-80GB (SM 8.0); the build was requested for NVIDIA H100 80GB HBM3 (SM 9.0)"
    )


def test_a_builder_image_pull_shows_as_the_builds_phase_and_keeps_its_heartbeat(llama, operator, settings):  # noqa: ANN001
    from deployments import states
    from workers.engines.executors import _PullPhase
    from workers.runtimes.docker import PullProgress

    build, _ = request(operator)
    states.build_transition(build_id=build.pk, to=BuildStatus.RUNNING, source="test")
    before = EngineBuild.objects.get(pk=build.pk).heartbeat_at
    _PullPhase(build.pk)(PullProgress(factories.IMAGE, 450, 1000, 0, 3))
    build.refresh_from_db()
    assert build.phase == "pulling image 45 %" and build.heartbeat_at > before
