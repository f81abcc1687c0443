"""Gantry's one home for NVML (nvidia-ml-py): the GPU inventory of this host.

A machine without an NVIDIA driver reports no GPUs and says why, rather than
failing: CPU-only hosts are valid hosts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pynvml

from hosts.services.hosts import GpuReport


@dataclass(frozen=True)
class Inventory:
    gpus: list[GpuReport] = field(default_factory=list)
    driver_version: str = ""
    cuda_version: str = ""
    error: str = ""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def read_inventory() -> Inventory:
    """Every GPU NVML sees, with driver and CUDA versions."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return Inventory(error=f"NVML unavailable: {exc}")
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                utilization = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
            except pynvml.NVMLError:
                utilization = 0
            try:
                power = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000  # milliwatts
            except pynvml.NVMLError:
                power = 0.0
            gpus.append(
                GpuReport(
                    index=index,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    compute_capability=f"{major}.{minor}",
                    memory_total_bytes=int(memory.total),
                    memory_used_bytes=int(memory.used),
                    utilization_percent=int(utilization),
                    power_watts=float(power),
                )
            )
        return Inventory(gpus=gpus, driver_version=driver, cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}")
    except pynvml.NVMLError as exc:
        return Inventory(error=f"NVML query failed: {exc}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def compute_processes(gpu_indexes: list[int] | tuple[int, ...]) -> dict[int, int]:
    """{pid: GPU memory bytes} of the compute processes on the given GPUs (empty without NVML)."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return {}
    try:
        found: dict[int, int] = {}
        for index in gpu_indexes:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                found[proc.pid] = found.get(proc.pid, 0) + int(proc.usedGpuMemory or 0)
        return found
    except pynvml.NVMLError:
        return {}
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
