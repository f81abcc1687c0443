"""Gantry's /metrics: the scrape token, the doors' figures, the control plane's
gauges read at scrape time, the host's re-export of Triton's figures with
deployment and replica labels, and the Grafana dashboard and Prometheus
config in docs/ naming only what Gantry exports."""

from __future__ import annotations

import asyncio
import http.server
import json
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from common import metrics
from common.asgi_io import Door, Doors
from controlplane.metrics import ControlPlane, MetricsDoor, owns
from core import queues
from core.models import Event
from deployments import live_figures
from tests import factories
from triton_server import metrics as triton_metrics
from workers import exporter
from workers.deploy import telemetry

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "scrape-token-for-tests"
TRITON_TEXT = """# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="llm",version="1"} 7
nv_inference_request_success{model="embedder",version="1"} 3
# HELP nv_gpu_utilization GPU utilization rate [0.0 - 1.0)
# TYPE nv_gpu_utilization gauge
nv_gpu_utilization{gpu_uuid="GPU-1"} 0.5
# HELP gantry_kv_cache_tokens Tokens the model's KV cache holds
# TYPE gantry_kv_cache_tokens gauge
gantry_kv_cache_tokens{model="llm",model_instance="llm_0_0",kind="used"} 96
gantry_kv_cache_tokens{model="llm",model_instance="llm_0_0",kind="capacity"} 1024
"""


@pytest.fixture
def metrics_on():  # noqa: ANN201
    before = settings.GANTRY_METRICS_TOKEN
    settings.GANTRY_METRICS_TOKEN = TOKEN
    metrics.token.cache_clear()
    yield TOKEN
    settings.GANTRY_METRICS_TOKEN = before
    metrics.token.cache_clear()


def _families(text: str | bytes) -> dict[str, list]:
    """Samples by name. prometheus_client's parser adds _total to a counter's samples
    that lack it (Triton's): they are filed under the name as written."""
    text = text.decode() if isinstance(text, bytes) else text
    written = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name if sample.name in written else sample.name.removesuffix("_total")
            found.setdefault(name, []).append(sample)
    return found


def _asgi_get(app, path: str, authorization: str | None = None) -> tuple[int, bytes]:  # noqa: ANN001
    headers = [(b"authorization", authorization.encode())] if authorization else []
    answer: dict = {"body": b""}

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        else:
            answer["body"] += message.get("body", b"")

    async def nothing(scope, receive, send) -> None:  # noqa: ANN001
        raise AssertionError("only /metrics reaches the door")

    scope = {"type": "http", "path": path, "method": "GET", "headers": headers}
    asyncio.run((app or Doors((Door("/metrics", owns, MetricsDoor(ControlPlane())),), nothing))(scope, receive, send))
    return answer["status"], answer["body"]


def test_the_scrape_token_is_required_and_metrics_are_off_without_one(transactional_db, metrics_on):  # noqa: ANN001
    assert metrics.scrape_allowed(f"Bearer {TOKEN}") and metrics.scrape_allowed(f"bearer {TOKEN}".encode())
    assert not metrics.scrape_allowed(None) and not metrics.scrape_allowed("Bearer wrong")
    assert not metrics.scrape_allowed(f"Basic {TOKEN}")
    assert _asgi_get(None, "/metrics")[0] == 401
    assert _asgi_get(None, "/metrics", "Bearer nope")[0] == 401
    status, body = _asgi_get(None, "/metrics", f"Bearer {TOKEN}")
    assert status == 200 and b"gantry_deployments" in body
    settings.GANTRY_METRICS_TOKEN = ""
    metrics.token.cache_clear()
    assert _asgi_get(None, "/metrics", f"Bearer {TOKEN}")[0] == 404
    assert not metrics.scrape_allowed(f"Bearer {TOKEN}")


def test_the_control_plane_counts_the_fleet_the_outbox_and_the_host_queues_at_scrape_time(
    transactional_db,
    metrics_on,
    host,
    minilm,  # noqa: ANN001
):
    from hosts import outbox

    created = factories.deployment(host=host, name="a")
    message = outbox.OutboxMessage.objects.create(task="workers.tasks.launch_replica", queue="x", args=[1])
    queue = queues.host_queue(host.name)
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    broker.delete(queue)
    # As Kombu writes a message: JSON with the task's headers, pushed on the left.
    broker.lpush(queue, json.dumps({"headers": {outbox.SENT_AT_HEADER: time.time() - 42}}))
    broker.lpush(queue, json.dumps({"headers": {outbox.SENT_AT_HEADER: time.time()}}))
    try:
        status, body = _asgi_get(None, "/metrics", f"Bearer {TOKEN}")
    finally:
        broker.delete(queue)
    found = _families(body)
    by = {(s.name, tuple(sorted(s.labels.items()))): s.value for name in found for s in found[name]}
    assert status == 200
    assert by[("gantry_deployments", (("status", created.status),))] == 1
    assert by[("gantry_outbox_messages", (("state", "waiting"),))] >= 1
    assert by[("gantry_outbox_oldest_age_seconds", ())] >= 0
    assert by[("gantry_celery_queue_length", (("queue", queue),))] == 2
    assert 41 <= by[("gantry_celery_oldest_task_age_seconds", (("queue", queue),))] < 60
    assert by[("gantry_hosts", (("state", "online"),))] + by[("gantry_hosts", (("state", "offline"),))] >= 1
    message.delete()


def test_scrapes_keep_one_broker_connection(transactional_db, metrics_on, host):  # noqa: ANN001
    """Each scrape reads the host queues over the connection the first one opened."""
    from controlplane import metrics as control_plane_metrics

    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    name = control_plane_metrics.broker_client_name()

    def connections() -> set[int]:
        return {client["id"] for client in broker.client_list() if client["name"] == name}

    assert _asgi_get(None, "/metrics", f"Bearer {TOKEN}")[0] == 200
    kept = connections()
    for _ in range(5):
        assert _asgi_get(None, "/metrics", f"Bearer {TOKEN}")[0] == 200
    assert len(kept) == 1 and connections() == kept


def test_a_door_request_is_counted_with_its_labels_and_timed(metrics_on):  # noqa: ANN001
    before = metrics.REQUESTS.labels("gateway", "chat", "7", "llm", "200", "ok")._value.get()
    metrics.observe_door(door="gateway", alias="chat", key="7", model="llm", code=200, duration_s=0.2,
                         first_token_s=0.05, inter_token_s=0.01, prompt_tokens=12, completion_tokens=30)  # fmt: skip
    metrics.observe_door(door="gateway", alias="", key="", model="", code=401, duration_s=0.001)
    found = _families(metrics.exposition(metrics.registry()))
    requests = {tuple(sorted(s.labels.items())): s.value for s in found["gantry_requests_total"]}
    assert requests[(("alias", "chat"), ("code", "200"), ("door", "gateway"), ("key", "7"), ("model", "llm"),
                     ("outcome", "ok"))] == before + 1  # fmt: skip
    assert any(dict(k).get("code") == "401" and dict(k)["outcome"] == "refused" for k in requests)
    first = [s for s in found["gantry_time_to_first_token_seconds_bucket"] if s.labels["alias"] == "chat"]
    assert {s.labels["le"] for s in first if s.value >= 1} >= {"0.05", "0.075", "+Inf"}
    assert any(s.labels["alias"] == "chat" for s in found["gantry_completion_tokens_sum"])


def test_the_host_re_exports_tritons_figures_with_deployment_and_replica_labels_and_nvml_once(metrics_on):  # noqa: ANN001
    scrape = triton_metrics.parse(TRITON_TEXT)
    labels = exporter.replica_labels(deployment="stack", replica_id=41, serial=2)
    exporter.keep_scrape(41, labels, scrape.text)
    exporter.scrape_failed(42, exporter.replica_labels(deployment="other", replica_id=42, serial=1))
    exporter.keep_memory(41, labels, {"llm": 3 * 2**30}, {"llm": 4 * 2**30, "embedder": 2**30})
    try:
        found = _families(exporter.exposition(metrics.registry(exporter.Host())))
    finally:
        exporter.forget(set())
    success = {s.labels["model"]: s for s in found["nv_inference_request_success"]}
    assert success["llm"].value == 7 and success["llm"].labels["deployment"] == "stack"
    assert success["llm"].labels["replica"] == "r2" and success["embedder"].labels["replica_id"] == "41"
    assert "nv_gpu_utilization" not in found  # every server repeats it: NVML's figure stands for it
    assert {s.labels["deployment"]: s.value for s in found["gantry_replica_scrape_ok"]} == {"stack": 1, "other": 0}
    kv = {s.labels["kind"]: s.value for s in found["gantry_kv_cache_tokens"]}
    assert kv == {"used": 96, "capacity": 1024}
    planned = {s.labels["model"]: s.value for s in found["gantry_model_gpu_memory_planned_bytes"]}
    assert planned == {"llm": 4 * 2**30, "embedder": 2**30}
    assert triton_metrics.derive(None, scrape)["llm"]["kv_cache_used_fraction"] == pytest.approx(96 / 1024, abs=1e-4)


def test_the_hosts_scrape_of_100_deployments_is_served_from_the_last_beat(metrics_on):  # noqa: ANN001
    text = TRITON_TEXT * 1  # three models' worth of families per server
    for replica_id in range(1, 101):
        labels = exporter.replica_labels(deployment=f"d{replica_id}", replica_id=replica_id, serial=1)
        exporter.keep_scrape(replica_id, labels, text)
    server = exporter.serve("127.0.0.1", _free_port())
    assert server is not None
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=5)  # noqa: S310
        assert refused.value.code == 401
        asked = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})  # noqa: S310
        with urllib.request.urlopen(asked, timeout=5) as answer:  # noqa: S310
            found = _families(answer.read())
        assert len(found["nv_inference_request_success"]) == 200
        assert len({s.labels["deployment"] for s in found["gantry_replica_scrape_ok"]}) == 100
    finally:
        server.shutdown()
        server.server_close()
        exporter.forget(set())


def test_live_figures_give_each_models_ttft_inter_token_and_tokens_per_second_over_the_last_minute():
    client = redis.Redis.from_url(settings.REDIS_URL)
    key = "gantry:figures:r9001"
    client.delete(key)
    now = time.time()
    # Newest first, as the doors push them; one line older than the window is left out.
    client.rpush(key, *[f"llm\t{now - i * 0.5:.3f}\t{0.010 + i / 1000:.6f}\t0.002000\t30" for i in range(100)])
    client.rpush(key, f"llm\t{now - 300:.3f}\t9.000000\t9.000000\t1000", f"emb\t{now:.3f}\t-\t-\t0")
    try:
        figures = live_figures.read(client, 9001, now=now)
    finally:
        client.delete(key)
    llm = figures["llm"]
    assert llm["generations"] == 100 and llm["tokens_per_s"] == pytest.approx(100 * 30 / 60)
    assert llm["ttft_p50_ms"] == pytest.approx(59.5, abs=0.01) and 108 < llm["ttft_p99_ms"] < 109
    assert llm["itl_p50_ms"] == llm["itl_p99_ms"] == pytest.approx(2.0)
    assert "emb" not in figures  # older than the window behind it, and no generated tokens either


def test_the_doors_push_figures_once_a_second_newest_first(monkeypatch):
    """Generations' lines wait in the process and reach Redis in one pipeline, in an
    order read() takes (newest first), not one round trip per generation."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete("gantry:figures:r9002")
    monkeypatch.setattr(live_figures, "FLUSH_S", 0.05)

    async def three() -> int:
        for i in range(3):
            live_figures.record_soon(replica_id=9002, model="llm", first_token_s=0.01 * (i + 1), inter_token_s=0.002,
                                     tokens=10)  # fmt: skip
            await asyncio.sleep(0)
        waiting = client.llen("gantry:figures:r9002")
        await asyncio.sleep(0.3)
        return waiting

    try:
        assert asyncio.run(three()) == 0  # nothing sent while the second runs
        lines = [line.decode().split("\t") for line in client.lrange("gantry:figures:r9002", 0, -1)]
        figures = live_figures.read(client, 9002)
    finally:
        client.delete("gantry:figures:r9002")
    assert [line[2] for line in lines] == ["0.030000", "0.020000", "0.010000"]
    assert figures["llm"]["generations"] == 3 and figures["llm"]["ttft_p50_ms"] == pytest.approx(20.0)


def test_a_scrape_that_fails_says_why_once_on_the_timeline_and_again_when_figures_are_back(
    transactional_db,
    host,
    minilm,  # noqa: ANN001
):
    deployment = factories.deployment_in(factories.deployment(host=host), "launching", "loading", "ready")
    replica = factories.replica_of(deployment)
    # A port where nothing listens: the real HTTP client is refused.
    replica.metrics_port = _free_port()
    for _ in range(3):
        telemetry.collect_metrics(replica)
    said = Event.objects.filter(deployment=deployment, kind="deployment.metrics_unreadable")
    assert said.count() == 1 and "refused" in said.get().message.lower()

    server = _triton_like(replica.metrics_port)
    try:
        telemetry.collect_metrics(replica)
    finally:
        server.shutdown()
        server.server_close()
    assert Event.objects.filter(deployment=deployment, kind="deployment.metrics_readable").count() == 1
    exporter.forget(set())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _triton_like(port: int) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = TRITON_TEXT.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# --- what docs/ ships --------------------------------------------------------------------

DASHBOARD = ROOT / "docs/grafana/gantry-dashboard.json"
# Grafana 10.4 to 11 write dashboards at this schema version; an import migrates older ones.
GRAFANA_SCHEMA_VERSION = 39
PANEL_TYPES = {"row", "timeseries", "stat"}
# Exported only by TensorRT-LLM engines (tensorrtllm_backend's metrics), which cannot run here.
ENGINE_ONLY = {"nv_trt_llm_kv_cache_block_metrics", "nv_trt_llm_inflight_batcher_metrics"}
PROMQL_WORDS = {"sum", "by", "rate", "histogram_quantile", "max", "min", "clamp_min", "le", "without", "on"}


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers and functions left out)."""
    bare = re.sub(r"\{[^}]*\}", "", expr)  # matchers
    bare = re.sub(r"\[[^\]]*\]", "", bare)  # ranges
    bare = re.sub(r"by \([^)]*\)", "", bare)
    bare = re.sub(r"(?<![\w.])\d[\d.]*(e[-+]?\d+)?", "", bare)  # numbers, 1e-9 too
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare)) - PROMQL_WORDS
    return {n for n in names if not re.fullmatch(r"e\d+|\d+", n)}


def exported_names() -> set[str]:
    """Every series name Gantry defines (its collectors' and the host's), with the
    suffixes Prometheus gives them."""
    names: set[str] = set()
    for collector in (metrics.REQUESTS, metrics.REQUEST_DURATION, metrics.TIME_TO_FIRST_TOKEN,
                      metrics.INTER_TOKEN_LATENCY, metrics.PROMPT_TOKENS, metrics.COMPLETION_TOKENS,
                      metrics.LIVE_SOCKETS, metrics.LIVE_MESSAGES, metrics.LIVE_MESSAGES_LOST,
                      metrics.BUILD_DURATION, metrics.LOADTEST_DURATION, metrics.WORKER_TASKS):  # fmt: skip
        for family in collector.describe():
            names |= {family.name, f"{family.name}_total", f"{family.name}_bucket", f"{family.name}_sum",
                      f"{family.name}_count"}  # fmt: skip
    return names


def test_the_dashboard_loads_at_grafanas_schema_version_and_each_panel_is_whole():
    board = json.loads(DASHBOARD.read_text())
    assert board["schemaVersion"] == GRAFANA_SCHEMA_VERSION and board["uid"] and board["title"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in board["templating"]["list"]}
    for panel in board["panels"]:
        assert panel["type"] in PANEL_TYPES, panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for target in panel.get("targets", []):
            assert target["refId"] and target["expr"] and target["datasource"]["uid"] == "${datasource}"
            assert set(re.findall(r"\$(\w+)", target["expr"])) <= variables


def test_every_dashboard_query_names_a_metric_gantry_or_triton_exports():
    defined = exported_names() | {
        "gantry_deployments", "gantry_replicas", "gantry_builds", "gantry_loadtests", "gantry_hosts",
        "gantry_outbox_messages", "gantry_outbox_oldest_age_seconds", "gantry_celery_queue_length",
        "gantry_celery_oldest_task_age_seconds", "gantry_replica_scrape_ok", "gantry_gpu_utilization_ratio",
        "gantry_gpu_memory_used_bytes", "gantry_gpu_memory_total_bytes", "gantry_gpu_power_watts",
        "gantry_model_gpu_memory_bytes", "gantry_model_gpu_memory_planned_bytes", triton_metrics.KV_CACHE_TOKENS,
        "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_queue_duration_us",
        "nv_inference_compute_infer_duration_us", "nv_inference_pending_request_count",
    }  # fmt: skip
    unknown = {n for expr in dashboard_queries() for n in metric_names(expr)} - defined - ENGINE_ONLY
    assert not unknown
    # The check can fail: a misspelt name is caught.
    assert metric_names("sum(rate(gantry_request_total[1m]))") - defined == {"gantry_request_total"}


def test_the_prometheus_config_in_docs_is_valid():
    config = yaml.safe_load((ROOT / "docs/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"gantry-web", "gantry-live", "gantry-hosts"}
    for job in jobs.values():
        assert job["metrics_path"] == "/metrics" and job["authorization"]["type"] == "Bearer"
        assert job["static_configs"][0]["targets"]
    assert jobs["gantry-hosts"]["static_configs"][0]["targets"][0].endswith(f":{settings.GANTRY_WORKER_METRICS_PORT}")
