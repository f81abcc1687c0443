"""The pages at fleet scale (make bench-pages).

With 100 deployments (each ready, with a model on a GPU of one of ten hosts,
and ten minutes of metric samples; the one under test an hour of them) and
100 000 events in PostgreSQL, headless Chromium opens the dashboard and a
deployment page from the web and live servers as make demo runs them, and
measures the time from asking for the page to a rendered, live page: the
socket says "live", the dashboard's sparklines or the deployment page's
charts are drawn. Each figure is printed beside its floor from the same run:
the same browser opening a bare page of the same web server (/healthz) and a
page of the same size and template with nothing live (the events page).

Target on localhost: under 1 s for each page.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import add_database_argument, percentile, server, setup_postgres  # noqa: E402

DEPLOYMENTS, EVENTS, HOSTS = 100, 100_000, 10


def _seed() -> int:
    """The rows (made once per database); the id of the deployment whose page is measured."""
    from django.contrib.auth.models import User
    from django.db import connection, transaction

    from deployments.models import (
        Deployment,
        DeploymentModel,
        Event,
        GpuHost,
        RegisteredModel,
        Replica,
    )
    from deployments.services import hosts

    if not User.objects.filter(username="bench").exists():
        User.objects.create_superuser("bench", password="bench")
    if Deployment.objects.filter(name__startswith="page-").count() >= DEPLOYMENTS:
        return _fresh_samples()
    for h in range(HOSTS):
        gpus = [
            hosts.GpuReport(index=i, uuid=f"GPU-{h:02d}-{i}", name="NVIDIA H100 80GB HBM3", compute_capability="9.0",
                    memory_total_bytes=85_520_809_984, memory_used_bytes=40_000_000_000, utilization_percent=35)
            for i in range(8)
        ]  # fmt: skip
        hosts.host_heartbeat(name=f"page-host-{h}", address="127.0.0.1", gpus=gpus)
    host_rows = list(GpuHost.objects.filter(name__startswith="page-host-").order_by("name"))
    ready = {"kind": "embedding", "path": "/bench", "host": host_rows[0], "inspection": "ready"}
    model, _ = RegisteredModel.objects.get_or_create(name="page-embedder", defaults=ready)
    with transaction.atomic():
        for d in range(DEPLOYMENTS):
            host = host_rows[d % HOSTS]
            deployment = Deployment.objects.create(name=f"page-{d}", status="ready", desired_state="running")
            Replica.objects.create(
                deployment=deployment, serial=1, host=host, status="ready", generation=1,
                http_port=20000 + 3 * d, grpc_port=20001 + 3 * d, metrics_port=20002 + 3 * d,
            )  # fmt: skip
            DeploymentModel.objects.create(
                deployment=deployment, triton_name="embedder", registered_model=model,
                instance_kind="KIND_GPU", gpu_ids=[d % 8], gpu_memory_fraction=0.1,
            )  # fmt: skip
        deployments = list(Deployment.objects.filter(name__startswith="page-").order_by("pk"))
        Event.objects.bulk_create(
            Event(
                kind="deployment.status", source="worker:page-host", deployment=deployments[i % DEPLOYMENTS],
                message=f"event {i}: a line of the kind the timeline holds", from_status="loading", to_status="ready",
            )
            for i in range(EVENTS)
        )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return _fresh_samples()


def _fresh_samples() -> int:
    """Metric samples ending now (every run: the pages show the last minutes): an hour
    for page-0, ten minutes for the others. Returns page-0's id."""
    from django.utils import timezone

    from deployments.models import Deployment, MetricSample

    now = timezone.now()
    deployments = list(Deployment.objects.filter(name__startswith="page-").order_by("pk"))
    MetricSample.objects.filter(deployment__in=deployments).delete()
    for d, deployment in enumerate(deployments):
        minutes = 60 if deployment.name == "page-0" else 10
        MetricSample.objects.bulk_create(
            MetricSample(
                deployment=deployment, at=now - timedelta(seconds=10 * s), kind=kind, subject=subject,
                values={"request_rate": 12.5, "failure_rate": 0.0, "queue_ms": 0.4, "compute_ms": 3.1}
                if kind == "model" else {"utilization": 0.35, "memory_used_bytes": 4e10},
            )
            for s in range(minutes * 6)
            for kind, subject in (("model", "embedder"), ("gpu", f"GPU-{d % HOSTS:02d}-{d % 8}"))
        )  # fmt: skip
    return Deployment.objects.get(name="page-0").pk


def _measure(page, url: str, ready: str, runs: int) -> list[float]:  # noqa: ANN001 - Playwright's Page
    """Milliseconds from asking for ``url`` until the JavaScript predicate ``ready`` holds."""
    times = []
    for _ in range(runs + 1):  # the first load warms the caches and the workers
        started = time.perf_counter()
        page.goto(url, wait_until="commit")
        page.wait_for_function(ready, timeout=30_000, polling=10)
        times.append((time.perf_counter() - started) * 1000)
    return times[1:]


def _line(name: str, figures: list[float], floor: list[float]) -> str:
    p50, p95 = percentile(figures, 0.5), percentile(figures, 0.95)
    return (
        f"  {name:<44} p50 {p50:7.0f} ms   p95 {p95:7.0f} ms   "
        f"floor p50 {percentile(floor, 0.5):5.0f} ms   {p50 / percentile(floor, 0.5):5.1f}x floor"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_database_argument(parser)
    parser.add_argument("--port", type=int, default=18750, help="web server port (live: +1)")
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()

    os.environ["GANTRY_LIVE_PORT"] = str(args.port + 1)
    setup_postgres(args.database_url)
    deployment = _seed()
    from playwright.sync_api import sync_playwright

    from controlplane.serving import live_argv, web_argv
    from tests.integration.conftest import CHROMIUM, CHROMIUM_ARGS

    base = f"http://127.0.0.1:{args.port}"
    print(f"{DEPLOYMENTS} deployments on {HOSTS} hosts of 8 GPUs, {EVENTS} events in PostgreSQL; "
          f"headless Chromium at 1280x800, {args.runs} loads each; {os.cpu_count()} cores")  # fmt: skip
    with (
        server(web_argv(sys.executable, bind="127.0.0.1", port=args.port), args.port),
        server(live_argv(sys.executable, bind="127.0.0.1", port=args.port + 1), args.port + 1),
        sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(f"{base}/login/")
        page.fill("input[name=username]", "bench")
        page.fill("input[name=password]", "bench")
        page.click("button[type=submit]")
        page.wait_for_url(f"{base}/")
        live = "document.body.dataset.live === 'up'"
        floor = _measure(page, f"{base}/healthz", "document.readyState !== 'loading'", args.runs)
        events = _measure(page, f"{base}/events/", "document.readyState === 'complete'", args.runs)
        dashboard = _measure(
            page, f"{base}/",
            f"{live} && document.querySelectorAll('[data-sparkline][data-points]').length === {DEPLOYMENTS}",
            args.runs,
        )  # fmt: skip
        detail = _measure(
            page, f"{base}/deployments/{deployment}/",
            f"{live} && Number(document.querySelector('figure[data-chart=request_rate]')?.dataset.points) > 300",
            args.runs,
        )  # fmt: skip
        browser.close()
    print(f"\n{'page, to rendered and live':<46}")
    print(_line("events page (100 rows, nothing live)", events, floor))
    print(_line(f"dashboard ({DEPLOYMENTS} sparklines, {HOSTS * 8} GPU bars)", dashboard, floor))
    print(_line("deployment page (an hour of charts, timeline)", detail, floor))
    print("  floor: the same browser opening /healthz; target: each page under 1000 ms")


if __name__ == "__main__":
    main()
