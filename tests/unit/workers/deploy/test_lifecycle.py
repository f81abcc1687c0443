"""Deployment jobs on the host: stop waits for NVML to show the GPU memory released, and a
launch refuses inputs that are not on the host."""

from __future__ import annotations

import pytest

from deployments import states
from deployments.models import Deployment, DeploymentStatus, RegisteredModel
from deployments.services import deployments
from deployments.services.placements import PlacementSpec
from tests import factories
from workers import nvml, processes
from workers.deploy import lifecycle


@pytest.fixture
def stopping(settings, gpu_host, minilm, operator, monkeypatch):
    settings.GANTRY_HOST_NAME = gpu_host.name
    settings.GANTRY_GPU_RELEASE_TIMEOUT = 1
    factories.surveyed()
    deployment = deployments.deployment_create(
        name="g", hosts=[gpu_host.name], placements=[PlacementSpec(model="minilm")], user=operator
    )
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    states.replica_transition(
        replica_id=factories.replica_of(deployment).pk, to="loading", source="t", runtime_handle="4242"
    )
    states.replica_transition(replica_id=factories.replica_of(deployment).pk, to="ready", source="t")
    deployments.deployment_stop(deployment_id=deployment.pk, user=operator)
    # The process seam: the server's group is pids 4242 and 4243, and stopping it is recorded.
    stopped = []
    monkeypatch.setattr(processes, "group_members", lambda pgid: [4242, 4243])
    monkeypatch.setattr(processes, "terminate_group", lambda pgid, **kwargs: stopped.append(pgid))
    return deployment, stopped


def test_stopped_once_nvml_shows_the_memory_released(stopping, monkeypatch):
    deployment, stopped = stopping
    answers = iter([{4242: 2**30, 999: 2**20}, {999: 2**20}])
    monkeypatch.setattr(nvml, "compute_processes", lambda gpus: next(answers))
    lifecycle.stop(factories.replica_of(deployment).pk)
    row = Deployment.objects.get(pk=deployment.pk)
    assert stopped == [4242]
    assert (row.status, row.status_message) == (DeploymentStatus.STOPPED, "tritonserver stopped")


def test_memory_still_held_after_the_timeout_is_not_called_stopped(stopping, monkeypatch):
    deployment, _ = stopping
    monkeypatch.setattr(nvml, "compute_processes", lambda gpus: {4243: 3 * 2**30})
    lifecycle.stop(factories.replica_of(deployment).pk)
    row = Deployment.objects.get(pk=deployment.pk)
    assert row.status == DeploymentStatus.FAILED
    assert "still shows its processes [4243] holding 3072 MiB on GPU(s) [0]" in row.status_message


def test_a_checkpoint_that_is_not_on_this_host_fails_the_launch_naming_it(settings, gpu_host, minilm, operator):
    """Registered on another host (or removed since): the launch fails before any server starts."""
    settings.GANTRY_HOST_NAME = gpu_host.name
    factories.surveyed()
    deployment = deployments.deployment_create(
        name="far", hosts=[gpu_host.name], placements=[PlacementSpec(model="minilm")], user=operator
    )
    deployments.deployment_start(deployment_id=deployment.pk, user=operator)
    elsewhere = factories.gpu_host("gpu-a")
    RegisteredModel.objects.filter(pk=minilm.pk).update(path="/models/only-on-a/minilm", host=elsewhere)
    lifecycle.launch(factories.replica_of(deployment).pk)
    row = Deployment.objects.get(pk=deployment.pk)
    assert row.status == DeploymentStatus.FAILED and not factories.replica_of(deployment).runtime_handle
    assert (
        f"minilm: checkpoint /models/only-on-a/minilm (registered on gpu-a) is not on {gpu_host.name}"
        in row.status_message
    )
