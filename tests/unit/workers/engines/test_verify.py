"""Verifying what trtllm-build wrote against the request, and that it stays on its host."""

from __future__ import annotations

import json
import shutil

import pytest

from common.errors import ValidationFailed
from core.models import Event
from deployments.models import BuildStatus, EngineBuild
from deployments.services import builds, deployments
from deployments.services.placements import PlacementSpec
from tests import factories
from workers.engines import reconcile, verify
from workers.jobs import JobFailed


def request(operator, **spec):  # noqa: ANN001, ANN003, ANN201
    return builds.build_request(model="llama", host="h100-host", image=factories.IMAGE, spec=spec, user=operator)


def test_engine_that_does_not_match_the_request_fails_verification(llama, operator, tmp_path):
    build, _ = request(operator, max_batch_size=16)
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "rank0.engine").write_bytes(b"x" * 10)
    config = {
        "version": "0.16.0",
        "pretrained_config": {"mapping": {"tp_size": 1, "pp_size": 1}},
        "build_config": {
            **{k: build.spec[k] for k in ("max_input_len", "max_seq_len", "max_num_tokens")},
            "max_batch_size": 8,
        },
    }
    (engine / "config.json").write_text(json.dumps(config))
    with pytest.raises(JobFailed, match="max_batch_size 8 instead of 16"):
        verify.verify_engine(build, engine)
    config["build_config"]["max_batch_size"] = 16
    (engine / "config.json").write_text(json.dumps(config))
    recorded = verify.verify_engine(build, engine)
    assert [a["name"] for a in recorded["artifacts"]] == ["config.json", "rank0.engine"]
    assert recorded["artifacts"][1]["size"] == 10 and len(recorded["artifacts"][1]["sha256"]) == 64


def test_an_engine_folder_gone_from_its_host_is_never_reused_or_served(llama, operator, settings, tmp_path):
    """The host finds a succeeded build's folder changed, then gone: an identical
    request compiles again, and a deployment may not name the build."""
    settings.GANTRY_HOST_NAME = "h100-host"
    build, how = request(operator, max_batch_size=16)
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "rank0.engine").write_bytes(b"x" * 10)
    builds.build_claim(build_id=build.pk, source="worker:h100-host", output_dir=str(engine))
    builds.build_finish(
        build_id=build.pk,
        to=BuildStatus.SUCCEEDED,
        source="worker:h100-host",
        message="ok",
        artifacts=[{"name": "rank0.engine", "size": 10, "sha256": "0" * 64}],
    )
    reconcile.reconcile_builds()
    assert request(operator, max_batch_size=16) == (EngineBuild.objects.get(pk=build.pk), "cached")

    (engine / "rank0.engine").write_bytes(b"x" * 3)
    reconcile.reconcile_builds()
    build.refresh_from_db()
    assert build.files_missing == f"in {engine}: rank0.engine (3 bytes, built as 10) changed"
    assert "no longer reused" in Event.objects.get(build=build, kind="build.files_missing").message
    again, how = request(operator, max_batch_size=16)
    assert how == "queued" and again.pk != build.pk
    with pytest.raises(ValidationFailed) as refused:
        factories.surveyed()
        deployments.deployment_create(
            name="old-engine",
            hosts=["h100-host"],
            runtime="docker",
            image=factories.IMAGE,
            placements=[PlacementSpec(model="llama", engine_build=build.pk, gpu_memory_fraction=0.9)],
            user=operator,
        )
    assert "build it again" in refused.value.errors["models[0].engine_build"][0]

    shutil.rmtree(engine)
    assert verify.engine_files_problem(build) == f"its folder {engine} is not on h100-host"
