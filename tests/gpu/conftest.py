"""The GPU suite (`make gpu-test`): runs on a GPU host, skipped where NVML sees no GPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from workers import nvml

# The seeds' stack through the control plane can be rehearsed on a CPU host
# (tests/gpu/test_seed_stack.py says how); every other GPU check needs a GPU.
REHEARSED = "test_seed_stack.py"


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001
    inventory = nvml.read_inventory()
    if inventory.gpus:
        return
    rehearsal = os.environ.get("GANTRY_GPU_SUITE_REHEARSAL") == "1"
    skip = pytest.mark.skip(reason=f"no GPU visible ({inventory.error or 'NVML lists none'})")
    for item in items:
        if "gpu" in item.keywords and not (rehearsal and item.path.name == REHEARSED):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def report() -> dict:
    """Figures the suite measures, written to $GANTRY_GPU_REPORT (JSON) at the end."""
    figures: dict = {}
    yield figures
    target = os.environ.get("GANTRY_GPU_REPORT")
    if target:
        Path(target).write_text(json.dumps(figures, indent=2, default=str))
