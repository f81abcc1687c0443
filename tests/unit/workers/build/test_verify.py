"""Verifying what trtllm-build wrote against the request."""

from __future__ import annotations

import json

import pytest

from deployments.services import builds
from tests import factories
from workers.build import verify
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
