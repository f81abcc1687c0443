"""Everything visible, read from the real thing: a running Gantry (web on
gunicorn with two processes, live, a host worker and a real tritonserver)
with a scrape token, scraped by a real Prometheus configured from
docs/prometheus.yml, queried with every query of the Grafana dashboard in
docs/, and the deployment's page showing what the doors saw of the LLM's
generations."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
import yaml
from websockets.sync.client import connect

from core.queues import host_queues
from tests.integration.conftest import ROOT, Stack, free_port, make_stack, stop_process, wait_for
from tests.integration.test_browser import _sign_in
from tests.integration.test_gateway import _alias, _client, _deploy, _key
from tests.unit.common.test_metrics import ENGINE_ONLY, _families, dashboard_queries, metric_names

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]
TOKEN = "a-scrape-token-only-prometheus-knows"
# Dashboard metrics this test does not make happen: no GPU here (NVML's figures and per-model
# memory), no engine build, load test or lost live message.
NOT_HAPPENING_HERE = ENGINE_ONLY | {
    "gantry_gpu_utilization_ratio", "gantry_gpu_memory_used_bytes", "gantry_gpu_memory_total_bytes",
    "gantry_gpu_power_watts", "gantry_model_gpu_memory_bytes", "gantry_model_gpu_memory_planned_bytes",
    "gantry_build_duration_seconds_bucket", "gantry_loadtest_duration_seconds_bucket",
    "gantry_live_messages_lost_total",
}  # fmt: skip


@pytest.fixture
def metered(transactional_db, tmp_path: Path, operator) -> Iterator[Stack]:  # noqa: ANN001
    port = free_port()
    env = {"GANTRY_METRICS_TOKEN": TOKEN, "GANTRY_WORKER_METRICS_PORT": str(port)}
    yield from make_stack(tmp_path, operator, extra_env=env)


def _scrape(url: str) -> dict[str, list]:
    answer = requests.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert answer.status_code == 200, answer.text
    return _families(answer.text)


def _value(found: dict[str, list], name: str, **labels: str) -> float:
    return sum(s.value for s in found.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def test_prometheus_scrapes_every_gantry_process_and_the_dashboard_and_page_show_the_figures(
    metered: Stack,
    tiny_llm: Path,
    minilm_path: Path,
    tmp_path: Path,
    page,
    screenshot,  # noqa: ANN001
):
    stack = metered
    live_url = stack.ws_url.replace("ws://", "http://")
    worker_url = f"http://127.0.0.1:{stack.env['GANTRY_WORKER_METRICS_PORT']}"
    for base in (stack.web_url, live_url, worker_url):
        refused = requests.get(f"{base}/metrics", headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert refused.status_code == 401, base

    stack.register_models(tiny_llm, tiny="llm")
    stack.register_models(minilm_path, minilm="embedding")
    deployment = _deploy(stack, "metered", [{"model": "tiny", "max_batch_size": 8}, {"model": "minilm"}])
    _alias(stack, "chat", deployment, "tiny")
    _alias(stack, "embedder", deployment, "minilm")
    client = _client(stack, _key(stack, all_aliases=True))
    headers = {"Authorization": f"Bearer {stack.token}", "Origin": stack.web_url}
    with connect(f"{stack.ws_url}/ws/deployments/{deployment['id']}/", additional_headers=headers) as socket:
        assert json.loads(socket.recv(timeout=10))["type"] == "hello"
        for i in range(6):
            stream = client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": f"count to {i}"}], max_tokens=12, stream=True
            )
            assert sum(1 for _ in stream) > 2
        client.embeddings.create(model="embedder", input=["a", "b"])
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="nobody", input=["a"])
        with pytest.raises(openai.AuthenticationError):
            _client(stack, {"key": "gk-not-a-key"}).models.list()

        # The generate action, streamed, with the stack's API token (its lean path).
        with stack.session().post(f"{stack.web_url}/api/deployments/{deployment['id']}/generate/",
                                  json={"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True},
                                  stream=True, timeout=60) as generated:  # fmt: skip
            assert generated.status_code == 200 and b'"done"' in b"".join(generated.iter_content(None))

        # Web: any of its two processes answers for both (multiprocess mode), the same each time.
        seen = [_scrape(f"{stack.web_url}/metrics") for _ in range(4)]
        ok = {_value(f, "gantry_requests_total", alias="chat", code="200", outcome="ok") for f in seen}
        assert ok == {6}
        web = seen[0]
        assert _value(web, "gantry_requests_total", code="404", outcome="refused") == 1
        assert _value(web, "gantry_requests_total", code="401", outcome="refused") >= 1
        assert _value(web, "gantry_time_to_first_token_seconds_count", alias="chat") == 6
        assert _value(web, "gantry_inter_token_latency_seconds_count", alias="chat") == 6
        assert _value(web, "gantry_completion_tokens_sum", alias="chat") > 6
        assert _value(web, "gantry_deployments", status="ready") >= 1
        assert _value(web, "gantry_requests_total", door="generate", model="tiny", code="200") == 1
        assert _value(web, "gantry_time_to_first_token_seconds_count", door="generate") == 1
        assert {s.labels["queue"] for s in web["gantry_celery_queue_length"]} >= set(host_queues(stack.host_name))

        # Live: the socket above, and what it was sent (the worker pushes the deployment's figures at each beat).
        def live_sent() -> dict | None:
            found = _scrape(f"{live_url}/metrics")
            return found if _value(found, "gantry_live_messages_total") >= 1 else None

        live = wait_for(live_sent, 30, "a message pushed over the deployment's socket")
        assert _value(live, "gantry_live_sockets") >= 1

    # The host: Triton's figures under Triton's names, with the deployment and replica beside the model.
    def host_figures() -> dict | None:
        found = _scrape(f"{worker_url}/metrics")
        done = _value(found, "nv_inference_request_success", deployment="metered", replica="r1", model="tiny")
        return found if done >= 6 else None

    host = wait_for(host_figures, 30, "the host's re-export of Triton's counters")
    assert _value(host, "gantry_replica_scrape_ok", deployment="metered") == 1
    assert _value(host, "gantry_kv_cache_tokens", deployment="metered", model="tiny", kind="capacity") > 0
    assert _value(host, "gantry_worker_tasks_total", state="SUCCESS") >= 1

    # The page: what the doors saw, per model, within a beat or two.
    http = stack.session()

    def page_figures() -> dict | None:
        samples = http.get(f"{stack.web_url}/api/deployments/{deployment['id']}/metrics/?kind=model&ordering=-id"
                           "&limit=50", timeout=10).json()["results"]  # fmt: skip
        return next((s["values"] for s in samples if s["subject"] == "tiny" and "ttft_p99_ms" in s["values"]), None)

    figures = wait_for(page_figures, 30, "TTFT and inter-token figures for the LLM")
    assert figures["ttft_p50_ms"] > 0 and figures["itl_p99_ms"] > 0 and figures["tokens_per_s"] > 0
    assert 0 <= figures["kv_cache_used_fraction"] <= 1
    _sign_in(page, stack, f"/deployments/{deployment['id']}/")
    page.wait_for_function("() => /\\d+\\.\\d \\/ \\d/.test(document.querySelector('#metrics').textContent)")
    screenshot("deployment-live-figures")

    # A real Prometheus, configured from docs/prometheus.yml, scrapes all three.
    _prometheus_scrapes_and_answers_the_dashboard(stack, tmp_path, live_url, worker_url)


def _prometheus_scrapes_and_answers_the_dashboard(stack: Stack, tmp_path: Path, live_url: str, worker_url: str) -> None:
    binary, promtool = shutil.which("prometheus"), shutil.which("promtool")
    assert binary and promtool, "make test installs Debian's prometheus"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    config = yaml.safe_load((ROOT / "docs/prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s")
    targets = {"gantry-web": stack.web_url, "gantry-live": live_url, "gantry-hosts": worker_url}
    for job in config["scrape_configs"]:
        job["authorization"]["credentials_file"] = str(token_file)
        job["static_configs"] = [{"targets": [targets[job["job_name"]].removeprefix("http://")]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    checked = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    port = free_port()
    server = subprocess.Popen(
        [binary, f"--config.file={path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=(tmp_path / "prometheus.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    api = f"http://127.0.0.1:{port}/api/v1"

    def query(expr: str) -> list[dict]:
        answer = requests.get(f"{api}/query", params={"query": expr}, timeout=10).json()
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    try:
        wait_for(lambda: _answers(f"{api}/status/buildinfo"), 30, "Prometheus")
        wait_for(lambda: len([r for r in query("up == 1")]) == 3, 30, "Prometheus to scrape web, live and the host")
        chats = query('sum(gantry_requests_total{alias="chat",outcome="ok"})')
        assert float(chats[0]["value"][1]) == 6
        served = query('sum(nv_inference_request_success{deployment="metered",model="tiny"})')
        assert float(served[0]["value"][1]) >= 6
        known = set(requests.get(f"{api}/label/__name__/values", timeout=10).json()["data"])
        for expr in dashboard_queries():
            query(expr.replace("$deployment", "metered"))  # each is valid PromQL
            missing = metric_names(expr) - known - NOT_HAPPENING_HERE
            assert not missing, (expr, missing)
    finally:
        stop_process(server)


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False
