"""Embedders and rerankers follow their checkpoint's own sentence-transformers
configuration, through the real worker and tritonserver: an embedder with its
own modelling code (behind auto_map, like nomic-embed) loads only when its
registration allows that code, its prompts and normalisation apply, and a
cross-encoder scores as sentence-transformers' CrossEncoder does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from deployments.models import Deployment
from tests import factories
from tests.integration.conftest import Stack, wait_for
from workers import processes
from workers.deploy import telemetry
from workers.untrained import make_untrained_encoder

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

TEXTS = ["A man is playing a guitar.", "Someone plays an instrument."]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    return {
        "embedder": make_untrained_encoder(root / "embedder", kind="embedding", remote_code=True),
        "reranker": make_untrained_encoder(root / "reranker", kind="reranker"),
    }


def _register(stack: Stack, name: str, kind: str, path: Path, *, trust: bool) -> dict:
    http = stack.session()
    body = {"name": name, "kind": kind, "path": str(path), "host": stack.host_name, "trust_remote_code": trust}
    created = http.post(f"{stack.web_url}/api/models/", json=body, timeout=30)
    assert created.status_code == 201, created.text
    url = f"{stack.web_url}/api/models/{created.json()['id']}/"
    return wait_for(lambda: (m := http.get(url, timeout=10).json())["inspection"] != "pending" and m, 60, "inspection")


def test_an_embedder_with_its_own_code_loads_only_when_allowed_and_follows_its_configuration(
    stack: Stack, encoders: dict[str, Path]
):
    from sentence_transformers import CrossEncoder, SentenceTransformer

    refused = _register(stack, "untrusted", "embedding", encoders["embedder"], trust=False)
    assert refused["inspection"] == "failed"
    assert (
        "needs its own Python code (auto_map in config.json (AutoConfig, AutoModel))" in refused["inspection_message"]
    )
    allowed = _register(stack, "embedder", "embedding", encoders["embedder"], trust=True)
    assert allowed["inspection"] == "ready", allowed["inspection_message"]
    assert _register(stack, "reranker", "reranker", encoders["reranker"], trust=False)["inspection"] == "ready"

    http = stack.session()
    created = http.post(
        f"{stack.web_url}/api/deployments/",
        json={"name": "sentences", "host": stack.host_name,
              "models": [{"model": "embedder", "max_seq_len": 512}, {"model": "reranker", "max_seq_len": 512}]},
        timeout=30,
    )  # fmt: skip
    assert created.status_code == 201, created.text
    deployment_id = created.json()["id"]
    assert http.post(f"{stack.web_url}/api/deployments/{deployment_id}/start/", timeout=30).status_code == 202
    wait_for(lambda: Deployment.objects.get(pk=deployment_id).status in ("ready", "failed"), 240, "the launch")
    row = factories.replica_row(deployment_id)
    assert row.status == "ready", row.status_message

    # Vectors as sentence-transformers makes them from the same folder: the document
    # prompt prepended, mean-pooled, normalised by the checkpoint's own modules.
    local = SentenceTransformer(str(encoders["embedder"]), trust_remote_code=True, local_files_only=True, device="cpu")
    answer = http.post(f"{stack.web_url}/api/deployments/{deployment_id}/embed/",
                       json={"texts": TEXTS, "model": "embedder"}, timeout=60)  # fmt: skip
    assert answer.status_code == 200, answer.text
    served = np.array(answer.json()["embeddings"])
    assert np.abs(served - local.encode(TEXTS)).max() < 1e-4
    assert np.abs(served - local.encode(TEXTS, prompt="")).max() > 1e-3  # the prompt made a difference
    assert np.allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-5)

    scores = http.post(f"{stack.web_url}/api/deployments/{deployment_id}/rerank/",
                       json={"query": "music", "passages": TEXTS, "model": "reranker"}, timeout=60)  # fmt: skip
    assert scores.status_code == 200, scores.text
    expected = CrossEncoder(str(encoders["reranker"]), local_files_only=True, device="cpu").predict(
        [("music", t) for t in TEXTS]
    )
    assert np.abs(np.array(scores.json()["scores"]) - expected).max() < 1e-4

    # The host agent names each stub process by the model it runs (NVML's per-process memory is shown so).
    stubs = set(processes.group_members(int(row.runtime_handle))) - {int(row.runtime_handle)}
    assert {telemetry._stub_model(pid) for pid in stubs} == {"embedder", "reranker"}
