"""Reads shared by pages, the API and consumers."""

from __future__ import annotations

import pytest

from common.errors import NotFound
from deployments import selectors
from tests import factories


def test_a_missing_build_is_not_found(db):
    with pytest.raises(NotFound, match="build 404 does not exist"):
        selectors.build_get(404)


def test_the_plan_adds_up_each_gpus_fractions_against_the_headroom(gpu_host, minilm, operator, settings):
    settings.GANTRY_GPU_MEMORY_HEADROOM = 0.95
    deployment = factories.deployment(
        host=gpu_host, user=operator, instance_kind="KIND_GPU", gpu_ids=(0,), gpu_memory_fraction=0.3
    )
    [gpu] = selectors.deployment_plan(selectors.deployment_list().get(pk=deployment.pk))
    assert (gpu["gpu"], gpu["fraction"], gpu["within_headroom"]) == (0, 0.3, True)
    [row] = gpu["models"]
    assert (row["triton_name"], row["fraction"], row["share"], row["own"]) == ("minilm", 0.3, 0.3, True)
    assert row["bytes"] == int(0.3 * gpu["memory_total_bytes"])
