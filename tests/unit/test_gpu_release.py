"""The GPU paths of the deployer, with NVML and the runtime replaced at their
seam (no GPU here; docs/ and the gpu marker cover real hardware)."""

import pytest

from deployments import services
from deployments.models import Deployment, DeploymentStatus
from workers import deployer, nvml


class FakeRuntime:
    def __init__(self):
        self.stopped = []

    def pids(self, handle, spec):
        return [4242, 4243]

    def stop(self, handle, spec):
        self.stopped.append(handle)


@pytest.fixture
def stopping(settings, gpu_host, minilm, operator, monkeypatch):
    settings.GANTRY_HOST_NAME = gpu_host.name
    settings.GANTRY_GPU_RELEASE_TIMEOUT = 1
    deployment = services.deployment_create(
        name="g", host_name=gpu_host.name, placements=[services.PlacementSpec(model="minilm")], user=operator
    )
    services.deployment_start(deployment_id=deployment.pk, user=operator)
    services.deployment_transition(deployment_id=deployment.pk, to="loading", source="t", runtime_handle="4242")
    services.deployment_transition(deployment_id=deployment.pk, to="ready", source="t")
    services.deployment_stop(deployment_id=deployment.pk, user=operator)
    runtime = FakeRuntime()
    monkeypatch.setattr(deployer, "runtime_for", lambda d: runtime)
    return deployment, runtime


def test_stopped_once_nvml_shows_the_memory_released(stopping, monkeypatch):
    deployment, runtime = stopping
    answers = iter([{4242: 2**30, 999: 2**20}, {999: 2**20}])
    monkeypatch.setattr(nvml, "compute_processes", lambda gpus: next(answers))
    deployer.stop(deployment.pk)
    row = Deployment.objects.get(pk=deployment.pk)
    assert runtime.stopped == ["4242"]
    assert (row.status, row.status_message) == (DeploymentStatus.STOPPED, "tritonserver stopped")


def test_memory_still_held_after_the_timeout_is_not_called_stopped(stopping, monkeypatch):
    deployment, _ = stopping
    monkeypatch.setattr(nvml, "compute_processes", lambda gpus: {4243: 3 * 2**30})
    deployer.stop(deployment.pk)
    row = Deployment.objects.get(pk=deployment.pk)
    assert row.status == DeploymentStatus.FAILED
    assert "still shows its processes [4243] holding 3072 MiB on GPU(s) [0]" in row.status_message


def test_nvml_figures_stand_in_when_triton_reports_zeros(gpu_host):
    inventory = nvml.Inventory(gpus=[services.GpuReport(0, "GPU-0000", "H100", "9.0", 80, 40, 55)])
    figures = deployer._gpu_figures({"GPU-0000": {"utilization": 0.0, "memory_used_bytes": 0.0}}, inventory)
    assert figures == {
        "GPU-0000": {"utilization": 0.55, "memory_used_bytes": 40, "memory_total_bytes": 80, "source": "nvml"}
    }
    triton = {"GPU-0000": {"utilization": 0.3, "memory_used_bytes": 7.0}}
    assert deployer._gpu_figures(triton, inventory) == triton
