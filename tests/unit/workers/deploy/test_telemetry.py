"""What a running server reports: GPU figures from Triton or NVML, and its log."""

from __future__ import annotations

from core.models import Event
from deployments.models import LogLine
from deployments.services import deployments
from deployments.services.placements import PlacementSpec
from hosts.services.hosts import GpuReport
from tests import factories
from workers import nvml
from workers.deploy import telemetry as deploy_telemetry
from workers.runtimes.process import ProcessRuntime


def test_nvml_figures_stand_in_when_triton_reports_zeros(gpu_host):
    inventory = nvml.Inventory(gpus=[GpuReport(0, "GPU-0000", "H100", "9.0", 80, 40, 55)])
    figures = deploy_telemetry._gpu_figures({"GPU-0000": {"utilization": 0.0, "memory_used_bytes": 0.0}}, inventory)
    assert figures == {
        "GPU-0000": {"utilization": 0.55, "memory_used_bytes": 40, "memory_total_bytes": 80, "source": "nvml"}
    }
    triton = {"GPU-0000": {"utilization": 0.3, "memory_used_bytes": 7.0}}
    assert deploy_telemetry._gpu_figures(triton, inventory) == triton


def test_a_server_log_that_cannot_be_read_is_said_once_on_the_timeline(settings, tmp_path, gpu_host, minilm, operator):
    settings.GANTRY_HOST_NAME = gpu_host.name
    factories.surveyed()
    created = deployments.deployment_create(
        name="unread", hosts=[gpu_host.name], placements=[PlacementSpec(model="minilm")], user=operator
    )
    deployment = factories.deployment_in(created, "launching", "loading", "ready", handle="4242")
    spec = factories.launch_spec(tmp_path / "d")
    spec.log_path.parent.mkdir(parents=True)
    spec.log_path.mkdir()  # a folder where the log should be: reading it fails
    for _ in range(3):
        deploy_telemetry.ship_log(factories.replica_of(deployment), ProcessRuntime(tmp_path), spec)
    [said] = Event.objects.filter(deployment=deployment, kind="deployment.log_unreadable")
    assert f"could not read the server's log {spec.log_path}: Is a directory" in said.message

    spec.log_path.rmdir()
    spec.log_path.write_text("a first line\nloaded minilm\n")
    deploy_telemetry.ship_log(factories.replica_of(deployment), ProcessRuntime(tmp_path), spec)
    assert list(LogLine.objects.filter(deployment=deployment).values_list("line", flat=True)) == ["loaded minilm"]
