"""What a running server reports: GPU figures from Triton or NVML."""

from __future__ import annotations

from deployments.services.hosts import GpuReport
from workers import nvml
from workers.deploy import telemetry as deploy_telemetry


def test_nvml_figures_stand_in_when_triton_reports_zeros(gpu_host):
    inventory = nvml.Inventory(gpus=[GpuReport(0, "GPU-0000", "H100", "9.0", 80, 40, 55)])
    figures = deploy_telemetry._gpu_figures({"GPU-0000": {"utilization": 0.0, "memory_used_bytes": 0.0}}, inventory)
    assert figures == {
        "GPU-0000": {"utilization": 0.55, "memory_used_bytes": 40, "memory_total_bytes": 80, "source": "nvml"}
    }
    triton = {"GPU-0000": {"utilization": 0.3, "memory_used_bytes": 7.0}}
    assert deploy_telemetry._gpu_figures(triton, inventory) == triton
