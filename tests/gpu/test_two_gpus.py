"""The fleet on two GPUs of one host (`make gpu-test` on a machine with two or
more; skipped with one, saying so). Through Gantry itself, as
test_seed_stack.py runs it (the demo's control plane on SQLite):

- the seeds' stack split over two GPUs by physical GPU ids: the LLM on GPU 0,
  the reranker and the embedder on GPU 1; NVML shows each model's processes on
  the GPU its replica's map names, and none on the other;
- one alias served by two LLM replicas, one per GPU (the first holds 0.80 of
  its GPU, so the second is mapped onto the other), streamed through /v1; then
  scaled 2 -> 1 with streams in flight: the retired replica drains them, and
  not one stream is cut.

The checkpoints are made on the machine (workers/untrained.py, untrained
weights: their text means nothing, their cost is real)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.gpu import control_plane
from tests.gpu.control_plane import TOKENIZER, wait_for
from tests.sse import StreamEnd, chat_stream
from workers import nvml
from workers.deploy.telemetry import _stub_model
from workers.untrained import make_untrained_encoder, make_untrained_llm

pytestmark = pytest.mark.gpu

GPUS = len(nvml.read_inventory().gpus)
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs two GPUs on one host; NVML sees {GPUS}")
STREAMS = 32
TOKENS = 256


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    root = tmp_path_factory.mktemp("models")
    make_untrained_llm(root / "llm", size="1b", tokenizer_dir=TOKENIZER)
    make_untrained_encoder(root / "reranker", kind="reranker", tokenizer_dir=TOKENIZER)
    make_untrained_encoder(root / "embedder", kind="embedding", tokenizer_dir=TOKENIZER)
    plane = control_plane.start(tmp_path_factory.mktemp("control-plane"), model_roots=[root])
    try:
        for name, kind in (("llm", "llm"), ("reranker", "reranker"), ("embedder", "embedding")):
            assert plane.register(name, kind, root / name)["inspection"] == "ready"
        yield plane
    finally:
        plane.stop()


def _models_on(gpu: int) -> set[str]:
    """The python models whose stubs hold memory on host GPU ``gpu`` (NVML)."""
    return {_stub_model(pid) for pid in nvml.compute_processes((gpu,))} - {""}


@needs_two
def test_the_seeds_stack_split_over_two_gpus_runs_where_its_map_says(plane):
    sentence = {"max_batch_size": 64, "max_seq_len": 512, "dtype": "float16", "instance_kind": "KIND_GPU"}
    body = {
        "name": "split", "host": plane.host, "physical_gpus": True,
        "models": [
            {"model": "llm", "gpu_memory_fraction": 0.80, "max_batch_size": 32, "max_seq_len": 2048,
             "instance_kind": "KIND_GPU", "gpu_ids": [0]},
            {"model": "reranker", "gpu_memory_fraction": 0.10, "gpu_ids": [1], **sentence},
            {"model": "embedder", "gpu_memory_fraction": 0.05, "gpu_ids": [1], **sentence},
        ],
    }  # fmt: skip
    deployment = plane.ok("POST", "/api/deployments/", 201, json=body)
    plane.ok("POST", f"/api/deployments/{deployment['id']}/start/", 202)
    ready = plane.wait_status(deployment["id"], {"ready", "failed"})
    assert ready["status"] == "ready", ready["status_message"]
    [replica] = ready["replica_set"]
    assert replica["gpus"] == {"0": 0, "1": 1}  # physical: the deployment's GPU ids are the host's
    on_0, on_1 = _models_on(0), _models_on(1)
    assert "llm" in on_0 and not {"reranker", "embedder"} & on_0, (on_0, on_1)
    assert {"reranker", "embedder"} <= on_1 and "llm" not in on_1, (on_0, on_1)
    plane.ok("POST", f"/api/deployments/{deployment['id']}/stop/", 202, json={"now": True})
    plane.wait_status(deployment["id"], {"stopped"})


@needs_two
def test_two_llm_replicas_one_per_gpu_and_a_scale_down_under_load_cuts_no_stream(plane, report):
    body = {
        "name": "pair", "host": plane.host, "replicas": 2, "placement_policy": "pack", "drain_timeout_s": 600,
        "models": [{"model": "llm", "gpu_memory_fraction": 0.80, "max_batch_size": 32, "max_seq_len": 2048,
                    "instance_kind": "KIND_GPU", "gpu_ids": [0]}],
    }  # fmt: skip
    deployment = plane.ok("POST", "/api/deployments/", 201, json=body)
    path = f"/api/deployments/{deployment['id']}/"
    plane.ok("POST", f"{path}start/", 202)
    ready = plane.wait_status(deployment["id"], {"ready", "failed"})
    assert ready["status"] == "ready", ready["status_message"]
    assert sorted(r["gpus"]["0"] for r in ready["replica_set"]) == [0, 1]  # one replica on each GPU
    assert "llm" in _models_on(0) and "llm" in _models_on(1)
    plane.ok(
        "POST", "/api/gateway/aliases/", 201, json={"name": "pair", "deployment": deployment["id"], "model": "llm"}
    )
    key = plane.ok("POST", "/api/gateway/keys/", 201, json={"name": "pair", "all_aliases": True})["key"]

    ended: list[StreamEnd | None] = [None] * STREAMS
    begun = threading.Semaphore(0)
    chat = {"model": "pair", "messages": [{"role": "user", "content": "Write about GPUs."}], "max_tokens": TOKENS}

    def one(i: int) -> None:
        ended[i] = chat_stream(f"{plane.url}/v1/chat/completions", key, chat, begun=begun)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert begun.acquire(timeout=300)
    asked = time.monotonic()
    scaled = plane.ok("POST", f"{path}scale/", 202, json={"replicas": 1})
    retired = next(r["serial"] for r in scaled["replica_set"] if r["desired_state"] == "stopped")
    wait_for(lambda: retired not in {r["serial"] for r in plane.ok("GET", path)["replica_set"]}, 660, "the retire")
    gone_s = time.monotonic() - asked
    for thread in threads:
        thread.join(timeout=600)
    cut = [e for e in ended if e is None or e.cut]
    report["two_gpus"] = {"streams": STREAMS, "cut": len(cut), "scale_down_to_gone_s": round(gone_s, 1)}
    assert not cut, cut
    plane.ok("POST", f"{path}stop/", 202, json={"now": True})
    plane.wait_status(deployment["id"], {"stopped"})
