"""The GPU suite (`make gpu-test`): runs on a GPU host, skipped where NVML sees no GPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from workers import nvml


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001
    inventory = nvml.read_inventory()
    if inventory.gpus:
        return
    skip = pytest.mark.skip(reason=f"no GPU visible ({inventory.error or 'NVML lists none'})")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def report() -> dict:
    """Figures the suite measures, written to $GANTRY_GPU_REPORT (JSON) at the end."""
    figures: dict = {}
    yield figures
    target = os.environ.get("GANTRY_GPU_REPORT")
    if target:
        Path(target).write_text(json.dumps(figures, indent=2, default=str))
