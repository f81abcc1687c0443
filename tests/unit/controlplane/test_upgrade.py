"""Upgrading from the previous release: its schema with rows in it, migrated to
this one, loses nothing. The previous release's migrations are those of the
last landed round (e88a8c0)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

PREVIOUS_RELEASE = [
    ("access", "0003_json_fields_read_with_orjson"),
    ("deployments", "0012_json_fields_read_with_orjson"),
    ("gateway", "0001_initial"),
    ("loadtests", "0003_json_fields_read_with_orjson"),
]


def _migrate(targets: list[tuple[str, str]]):  # noqa: ANN202 - the historical apps
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return MigrationExecutor(connection).loader.project_state(targets).apps


@pytest.mark.django_db(transaction=True)
def test_the_previous_releases_rows_survive_the_upgrade():
    latest = MigrationExecutor(connection).loader.graph.leaf_nodes()
    old = _migrate(PREVIOUS_RELEASE)
    try:
        user = old.get_model("auth", "User").objects.create(username="kept", is_superuser=True)
        host = old.get_model("deployments", "GpuHost").objects.create(name="gpu-01", address="10.0.0.1")
        model = old.get_model("deployments", "RegisteredModel").objects.create(
            name="llama", kind="llm", path="/models/llama", host=host
        )
        artifacts = [{"name": "rank0.engine", "size": 10, "sha256": "0" * 64}]
        build = old.get_model("deployments", "EngineBuild").objects.create(
            model=model, host=host, cache_key="k" * 64, status="succeeded", output_dir="/engines/1", artifacts=artifacts
        )
        deployment = old.get_model("deployments", "Deployment").objects.create(
            name="stack", host=host, http_port=18000, grpc_port=18001, metrics_port=18002, created_by=user
        )
        old.get_model("deployments", "DeploymentModel").objects.create(
            deployment=deployment, registered_model=model, triton_name="llama", gpu_memory_fraction=0.8
        )
        old.get_model("deployments", "Event").objects.create(kind="deployment.created", source="t", message="made")
        old.get_model("access", "ApiToken").objects.create(user=user, name="ci", prefix="gt-abc", digest="d" * 64)
        old.get_model("gateway", "Alias").objects.create(name="chat", deployment=deployment, triton_name="llama")
    finally:
        new = _migrate(latest)

    assert new.get_model("auth", "User").objects.get(username="kept").is_superuser
    upgraded = new.get_model("deployments", "EngineBuild").objects.get(pk=build.pk)
    assert (upgraded.status, upgraded.output_dir, upgraded.files_missing) == ("succeeded", "/engines/1", "")
    assert upgraded.artifacts[0]["name"] == "rank0.engine"
    placement = new.get_model("deployments", "DeploymentModel").objects.get(deployment_id=deployment.pk)
    assert (placement.triton_name, placement.gpu_memory_fraction) == ("llama", 0.8)
    # Hosts moved to their own app and the timeline to core, their tables kept.
    moved = new.get_model("hosts", "GpuHost").objects.get(pk=host.pk)
    assert (moved.name, upgraded.host_id) == ("gpu-01", host.pk)
    assert new.get_model("core", "Event").objects.filter(message="made").count() == 1
    assert new.get_model("access", "ApiToken").objects.get(name="ci").digest == "d" * 64
    assert new.get_model("gateway", "Alias").objects.get(name="chat").deployment_id == deployment.pk
