"""The seeds' stack on the GPU through Gantry itself: the control plane runs
(web, live, a worker with its host agent, Redis; SQLite), three checkpoints
made on the machine are registered through the REST API (a ~1B Llama, a BERT
cross-encoder reranker, a BERT embedder with its own modelling code) and
deployed as the seeds' split of GPU 0 (LLM 0.80, reranker 0.10, embedder 0.05,
batch sizes 32/64/128, 16-bit sentence models of 512 tokens); they answer
through /v1 with the openai client; NVML's memory of each model's processes
stays within its plan; a stored load test (AIPerf) runs at 1, 8 and 32 streams
with embed and rerank load beside it; a second deployment on the same GPU is
refused at start, naming the first; a stop leaves the GPU free.

GANTRY_GPU_SUITE_REHEARSAL=1 runs the same path on a CPU host with a tiny LLM
and no GPU checks, so a change can be tried before a GPU run."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from tests.gpu import control_plane
from tests.gpu.control_plane import TOKENIZER
from workers import nvml
from workers.untrained import make_untrained_encoder, make_untrained_llm

pytestmark = pytest.mark.gpu
REHEARSAL = os.environ.get("GANTRY_GPU_SUITE_REHEARSAL") == "1"
SPLIT = {"llm": 0.80, "reranker": 0.10, "embedder": 0.05}
BATCH = {"llm": 32, "reranker": 64, "embedder": 128}
LEVELS = [1, 2] if REHEARSAL else [1, 8, 32]
LLM_SEQ = 512 if REHEARSAL else 2048  # the tiny LLM has 512 positions
SCRAPE_TOKEN = "gpu-suite-scrape-token"
SENTENCES = [f"Sentence number {i} about GPUs, models and serving." for i in range(16)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = Path(os.environ.get("GANTRY_GPU_SUITE_MODELS") or tmp_path_factory.mktemp("models"))
    started = time.monotonic()
    made = {
        "llm": make_untrained_llm(
            root / ("llm-tiny" if REHEARSAL else "llm-1b"), size="tiny" if REHEARSAL else "1b", tokenizer_dir=TOKENIZER
        ),
        "reranker": make_untrained_encoder(root / "reranker", kind="reranker", tokenizer_dir=TOKENIZER),
        "embedder": make_untrained_encoder(
            root / "embedder", kind="embedding", remote_code=True, tokenizer_dir=TOKENIZER
        ),
    }
    made["seconds"] = round(time.monotonic() - started, 1)  # type: ignore[assignment]
    return made


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[str, Path]):  # noqa: ANN201
    work = tmp_path_factory.mktemp("control-plane")
    root = checkpoints["llm"].parent
    # Prometheus on: the host's /metrics is read during the load test (_host_metrics).
    plane = control_plane.start(work, model_roots=[root], extra_env={"GANTRY_METRICS_TOKEN": SCRAPE_TOKEN})
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="module")
def stack(plane: control_plane.ControlPlane, checkpoints: dict[str, Path], report: dict):  # noqa: ANN201
    """The seeds' stack registered, planned, started and ready, with aliases and a key."""
    refused = plane.register("embedder-untrusted", "embedding", checkpoints["embedder"])
    assert refused["inspection"] == "failed" and "needs its own Python code" in refused["inspection_message"]
    for name, kind, trust in (("llm", "llm", False), ("reranker", "reranker", False), ("embedder", "embedding", True)):
        model = plane.register(name, kind, checkpoints[name], trust=trust)
        assert model["inspection"] == "ready", model["inspection_message"]
    gpu = {} if REHEARSAL else {"instance_kind": "KIND_GPU", "gpu_ids": [0]}
    half = {} if REHEARSAL else {"dtype": "float16"}
    models = [
        {
            "model": "llm",
            "gpu_memory_fraction": SPLIT["llm"],
            "max_batch_size": BATCH["llm"],
            "max_seq_len": LLM_SEQ,
            "max_queue_delay_us": 1000,
            **gpu,
        },
        {
            "model": "reranker",
            "gpu_memory_fraction": SPLIT["reranker"],
            "max_batch_size": BATCH["reranker"],
            "max_seq_len": 512,
            "max_queue_delay_us": 1000,
            **gpu,
            **half,
        },
        {
            "model": "embedder",
            "gpu_memory_fraction": SPLIT["embedder"],
            "max_batch_size": BATCH["embedder"],
            "max_seq_len": 512,
            "max_queue_delay_us": 1000,
            **gpu,
            **half,
        },
    ]
    body = {"name": "seeds", "host": plane.host, "models": models}
    preflight = plane.ok("POST", "/api/deployments/preflight/", json=body)
    assert preflight["valid"], preflight["errors"]
    deployment = plane.ok("POST", "/api/deployments/", 201, json=body)
    started = time.monotonic()
    plane.ok("POST", f"/api/deployments/{deployment['id']}/start/", 202)
    ready = plane.wait_status(deployment["id"], {"ready", "failed"})
    assert ready["status"] == "ready", ready["status_message"]
    for alias in ("llm", "reranker", "embedder"):
        plane.ok(
            "POST",
            "/api/gateway/aliases/",
            201,
            json={"name": f"seed-{alias}", "deployment": deployment["id"], "model": alias},
        )
    key = plane.ok("POST", "/api/gateway/keys/", 201, json={"name": "suite", "all_aliases": True})["key"]
    report["stack"] = {
        "making_checkpoints_s": checkpoints["seconds"],
        "launch_to_ready_s": round(time.monotonic() - started, 1),
        "plan": plane.ok("GET", f"/api/deployments/{deployment['id']}/plan/"),
    }
    return {"id": deployment["id"], "key": key}


def test_the_seeds_split_is_planned_per_gpu_within_the_headroom(plane, stack):
    plan = plane.ok("GET", f"/api/deployments/{stack['id']}/plan/")
    if REHEARSAL:
        assert plan == []  # nothing on a GPU
        return
    [gpu] = plan
    assert gpu["fraction"] == pytest.approx(0.95) and gpu["within_headroom"] and gpu["contexts_fit"]
    assert {m["triton_name"]: m["share"] for m in gpu["models"]} == pytest.approx(SPLIT)
    assert gpu["processes"] == 4  # three python stubs and tritonserver
    llm = next(m for m in gpu["models"] if m["triton_name"] == "llm")
    assert llm["kv_cache_bytes"] > 0 and llm["weights_bytes"] > 2e9


def test_the_stack_answers_through_the_gateway_with_the_openai_client(plane, stack, checkpoints, report):
    import openai
    from sentence_transformers import CrossEncoder, SentenceTransformer

    client = openai.OpenAI(base_url=f"{plane.url}/v1", api_key=stack["key"], max_retries=0)
    chat = client.chat.completions.create(model="seed-llm", messages=[{"role": "user", "content": "Hi"}], max_tokens=16)
    assert chat.usage.completion_tokens == 16 and chat.usage.prompt_tokens > 0
    streamed = list(
        client.chat.completions.create(
            model="seed-llm", messages=[{"role": "user", "content": "Hi"}], max_tokens=16, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    vectors = np.array([e.embedding for e in client.embeddings.create(model="seed-embedder", input=SENTENCES).data])
    device = "cpu" if REHEARSAL else "cuda:0"
    half = {} if REHEARSAL else {"model_kwargs": {"dtype": "float16"}}
    local = SentenceTransformer(
        str(checkpoints["embedder"]), trust_remote_code=True, local_files_only=True, device=device, **half
    ).encode(SENTENCES)
    cosine = np.sum(vectors * local, axis=1) / (np.linalg.norm(vectors, axis=1) * np.linalg.norm(local, axis=1))
    assert cosine.min() > 0.999 and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)
    ranked = requests.post(
        f"{plane.url}/v1/rerank",
        headers={"Authorization": f"Bearer {stack['key']}"},
        json={"model": "seed-reranker", "query": "GPUs", "documents": SENTENCES[:8]},
        timeout=60,
    )
    assert ranked.status_code == 200, ranked.text
    served = {r["index"]: r["relevance_score"] for r in ranked.json()["results"]}
    expected = CrossEncoder(str(checkpoints["reranker"]), local_files_only=True, device=device, **half).predict(
        [("GPUs", s) for s in SENTENCES[:8]]
    )
    assert max(abs(served[i] - float(expected[i])) for i in served) < 1e-2
    report["answers"] = {
        "chat_tokens": chat.usage.completion_tokens,
        "embedding_cosine_vs_local_min": float(cosine.min()),
    }


def _memory(plane, deployment_id: int) -> dict[str, int]:
    """The newest NVML figure of each model's processes, as the host agent reports it."""
    samples = plane.ok("GET", f"/api/deployments/{deployment_id}/metrics/?minutes=5&kind=model&ordering=-id&limit=200")
    latest: dict[str, int] = {}
    for sample in samples["results"]:
        if "gpu_memory_bytes" in sample["values"]:
            latest.setdefault(sample["subject"], sample["values"]["gpu_memory_bytes"])
    return latest


def _host_metrics(plane) -> dict[str, float]:  # noqa: ANN001
    """A few of the host worker's Prometheus figures (its own /metrics, with the scrape token)."""
    from prometheus_client.parser import text_string_to_metric_families

    port = plane.env["GANTRY_WORKER_METRICS_PORT"]
    answer = requests.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {SCRAPE_TOKEN}"},
                          timeout=10)  # fmt: skip
    assert answer.status_code == 200, answer.text
    found: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        found[key] = found.get(key, 0.0) + value

    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "gantry_kv_cache_tokens" and labels.get("model") == "llm":
                add(f"kv_{labels['kind']}_tokens", sample.value)
            elif sample.name == "gantry_gpu_power_watts":
                add("gpu_power_watts", sample.value)
            elif sample.name == "gantry_model_gpu_memory_bytes" and labels.get("model") == "llm":
                add("llm_gpu_memory_bytes", sample.value)
            elif sample.name.startswith("nv_inference_request_success") and labels.get("model") == "llm":
                add("triton_llm_requests", sample.value)
    return found


def _page_figures(plane, deployment_id: int) -> dict[str, float]:  # noqa: ANN001
    """The LLM's latest TTFT, inter-token and tokens/s figures, as the deployment page gets them."""
    samples = plane.ok("GET", f"/api/deployments/{deployment_id}/metrics/?minutes=5&kind=model&ordering=-id&limit=50")
    return next((s["values"] for s in samples["results"] if s["subject"] == "llm" and "ttft_p99_ms" in s["values"]),
                {})  # fmt: skip


def _side_load(plane, key: str, stop: threading.Event, counts: dict) -> list[threading.Thread]:
    """Embed (16 sentences) and rerank (a query and 8 passages) requests through /v1, back to back."""
    headers = {"Authorization": f"Bearer {key}"}

    def fire(kind: str) -> None:
        session = requests.Session()
        while not stop.is_set():
            if kind == "embed":
                body, path = {"model": "seed-embedder", "input": SENTENCES}, "/v1/embeddings"
            else:
                body, path = {"model": "seed-reranker", "query": "GPUs", "documents": SENTENCES[:8]}, "/v1/rerank"
            try:
                ok = session.post(f"{plane.url}{path}", json=body, headers=headers, timeout=60).status_code == 200
            except requests.RequestException:
                ok = False
            counts[kind] += 1 if ok else 0
            counts[f"{kind}_errors"] += 0 if ok else 1

    threads = [threading.Thread(target=fire, args=(kind,), daemon=True) for kind in ("embed", "rerank")]
    for thread in threads:
        thread.start()
    return threads


def _rates(plane, key: str, seconds: float) -> dict[str, float]:
    counts = {"embed": 0, "rerank": 0, "embed_errors": 0, "rerank_errors": 0}
    stop = threading.Event()
    threads = _side_load(plane, key, stop, counts)
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    return {k: round(v / seconds, 2) for k, v in counts.items()}


def test_a_stored_load_test_at_1_8_32_streams_with_embed_and_rerank_beside_it(plane, stack, report):
    alone = _rates(plane, stack["key"], 10)
    counts = {"embed": 0, "rerank": 0, "embed_errors": 0, "rerank_errors": 0}
    stop = threading.Event()
    threads = _side_load(plane, stack["key"], stop, counts)
    started = time.monotonic()
    workload = {"levels": LEVELS, "duration_s": 12, "input_tokens": 128, "output_tokens": 64, "warmup_requests": 2}
    run = plane.ok(
        "POST",
        "/api/loadtests/",
        201,
        json={"deployment": stack["id"], "model": "seed-llm", "workload": workload, "confirm": True},
    )
    peaks: dict[str, int] = {}
    exported: dict[str, float] = {}
    while (current := plane.ok("GET", f"/api/loadtests/{run['id']}/"))["status"] in ("queued", "running"):
        for name, used in _memory(plane, stack["id"]).items():
            peaks[name] = max(peaks.get(name, 0), used)
        for name, value in _host_metrics(plane).items():
            exported[name] = max(exported.get(name, 0.0), value)
        time.sleep(2)
    beside_s = time.monotonic() - started
    stop.set()
    for thread in threads:
        thread.join()
    assert current["status"] == "succeeded", (current["status_message"], current["log_tail"])
    rows = plane.ok("GET", f"/api/loadtests/export/?ids={run['id']}&file=json")
    figures = {row["level"]: row for row in (rows["rows"] if isinstance(rows, dict) else rows)}
    assert sorted(figures) == LEVELS
    assert all(row["counted.errors"] in (0, None) for row in figures.values()), figures
    beside = {k: round(v / beside_s, 2) for k, v in counts.items()}
    assert beside["embed"] > 0 and beside["rerank"] > 0 and beside["embed_errors"] == beside["rerank_errors"] == 0
    # What Prometheus would read from the host during the run, and what the page showed.
    assert exported.get("kv_used_tokens", 0) > 0 and exported["kv_capacity_tokens"] > 0, exported
    assert exported["triton_llm_requests"] > 0, exported
    page = _page_figures(plane, stack["id"])
    assert page.get("ttft_p99_ms", 0) > 0 and page.get("tokens_per_s", 0) > 0, page
    report["metrics"] = {"host_peaks": exported, "page_llm_last": page}
    report["load_test"] = {
        "run": run["id"],
        "levels": figures,
        "embed_rerank_alone": alone,
        "embed_rerank_beside_llm": beside,
    }
    if REHEARSAL:
        return
    assert exported["gpu_power_watts"] > 0 and exported["llm_gpu_memory_bytes"] > 0, exported
    # NVML's memory of each model's processes, sampled through the run, within its plan (share and contexts).
    budgets = {
        m["triton_name"]: m["nvml_budget_bytes"]
        for m in plane.ok("GET", f"/api/deployments/{stack['id']}/plan/")[0]["models"]
    }
    assert set(budgets) <= set(peaks), (budgets, peaks)
    assert all(peaks[name] <= budget for name, budget in budgets.items()), (peaks, budgets)
    report["load_test"]["peak_gpu_memory_bytes"] = peaks
    report["load_test"]["nvml_budget_bytes"] = budgets


def test_a_second_deployment_on_the_same_gpu_is_refused_at_start_naming_the_first(plane, stack):
    if REHEARSAL:
        pytest.skip("the host plan needs a GPU")
    body = {
        "name": "second",
        "host": plane.host,
        "models": [{"model": "reranker", "gpu_memory_fraction": 0.8, "instance_kind": "KIND_GPU", "gpu_ids": [0]}],
    }
    second = plane.ok("POST", "/api/deployments/", 201, json=body)
    refused = plane.api("POST", f"/api/deployments/{second['id']}/start/")
    assert refused.status_code == 409, refused.text
    assert "memory fractions add up to 1.75 together with seeds r1 (ready)" in refused.json()["detail"]
    plane.ok("DELETE", f"/api/deployments/{second['id']}/", 204)


def test_a_stop_leaves_the_gpu_free(plane, stack):
    plane.ok("POST", f"/api/deployments/{stack['id']}/stop/", 202)
    stopped = plane.wait_status(stack["id"], {"stopped", "failed"}, timeout_s=180)
    assert stopped["status"] == "stopped", stopped["status_message"]
    if not REHEARSAL:
        # Nothing holds GPU memory but this test process (its own copies of the encoders, above).
        assert set(nvml.compute_processes([0])) <= {os.getpid()}
