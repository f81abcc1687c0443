"""The pages at fleet scale (make bench-pages).

A fleet of 100 hosts of 8 GPUs each, 100 000 events in PostgreSQL, and
deployments (each ready, one replica with a model on a GPU, ten minutes of
request-rate samples) grown to 100, 1 000 and 10 000. At each size headless
Chromium opens the dashboard from the web and live servers as make demo runs
them, and measures the time from asking for the page to a rendered, live
page: the socket says "live" and the sparklines of the rows in view are drawn.
At 100 it also opens a deployment page (an hour of charts). Each figure is
printed beside its floors from the same run: the same browser opening a bare
page of the same web server (/healthz), and a page of the same template with
nothing live (the events page).

Target on localhost: under 1 s for each page at every size.
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

SIZES, EVENTS, HOSTS, GPUS = (100, 1_000, 10_000), 100_000, 100, 8


def _seed(size: int) -> int:
    """Grow the fleet to ``size`` deployments (hosts, model and events made once per
    database); fresh samples ending now. Returns page-0's id."""
    from django.contrib.auth.models import User
    from django.db import connection, transaction

    from core.models import Event
    from deployments.models import Deployment, DeploymentModel, RegisteredModel, Replica
    from hosts.models import GpuHost
    from hosts.services import hosts

    if not User.objects.filter(username="bench").exists():
        User.objects.create_superuser("bench", password="bench")
    if GpuHost.objects.filter(name__startswith="page-host-").count() < HOSTS:
        for h in range(HOSTS):
            gpus = [
                hosts.GpuReport(index=i, uuid=f"GPU-{h:03d}-{i}", name="NVIDIA H100 80GB HBM3",
                                compute_capability="9.0", memory_total_bytes=85_520_809_984,
                                memory_used_bytes=40_000_000_000, utilization_percent=35)
                for i in range(GPUS)
            ]  # fmt: skip
            hosts.host_heartbeat(name=f"page-host-{h:03d}", address="127.0.0.1", gpus=gpus)
    host_rows = list(GpuHost.objects.filter(name__startswith="page-host-").order_by("name"))
    GpuHost.objects.filter(pk__in=[h.pk for h in host_rows]).update(last_heartbeat=_now())
    ready = {"kind": "embedding", "path": "/bench", "host": host_rows[0], "inspection": "ready"}
    model, _ = RegisteredModel.objects.get_or_create(name="page-embedder", defaults=ready)
    have = Deployment.objects.filter(name__startswith="page-").count()
    with transaction.atomic():
        made = Deployment.objects.bulk_create(
            Deployment(name=f"page-{d:05d}", status="ready", desired_state="running") for d in range(have, size)
        )
        for start in range(0, len(made), 2000):
            chunk = list(enumerate(made[start : start + 2000], start=have + start))
            Replica.objects.bulk_create(
                Replica(deployment=row, serial=1, host=host_rows[d % HOSTS], status="ready", generation=1,
                        gpu_map={"0": (d // HOSTS) % GPUS}, http_port=20000 + 3 * (d // HOSTS),
                        grpc_port=20001 + 3 * (d // HOSTS), metrics_port=20002 + 3 * (d // HOSTS))
                for d, row in chunk
            )  # fmt: skip
            DeploymentModel.objects.bulk_create(
                DeploymentModel(deployment=row, triton_name="embedder", registered_model=model,
                                instance_kind="KIND_GPU", gpu_ids=[0], gpu_memory_fraction=0.01)
                for _, row in chunk
            )  # fmt: skip
        if not Event.objects.filter(source="worker:page-host").exists():
            first = list(Deployment.objects.filter(name__startswith="page-").order_by("pk")[:100])
            Event.objects.bulk_create(
                (
                    Event(
                        kind="deployment.status", source="worker:page-host", deployment=first[i % len(first)],
                        message=f"event {i}: a line of the kind the timeline holds", from_status="loading",
                        to_status="ready",
                    )
                    for i in range(EVENTS)
                ),
                batch_size=5000,
            )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return _fresh_samples()


def _now():  # noqa: ANN202 - a datetime
    from django.utils import timezone

    return timezone.now()


def _fresh_samples() -> int:
    """Request-rate samples ending now (every run: the pages show the last minutes): an
    hour for page-00000 (with its GPU's), ten minutes for every other. Returns page-00000's id."""
    from deployments.models import Deployment, MetricSample

    now = _now()
    MetricSample.objects.filter(deployment__name__startswith="page-").delete()
    rows = list(Deployment.objects.filter(name__startswith="page-").order_by("pk").values_list("pk", "name"))
    for start in range(0, len(rows), 500):
        MetricSample.objects.bulk_create(
            (
                MetricSample(
                    deployment_id=pk, at=now - timedelta(seconds=10 * s), kind=kind, subject=subject,
                    values={"request_rate": 12.5, "failure_rate": 0.0, "queue_ms": 0.4, "compute_ms": 3.1}
                    if kind == "model" else {"utilization": 0.35, "memory_used_bytes": 4e10},
                )
                for pk, name in rows[start : start + 500]
                for s in range((60 if name == "page-00000" else 10) * 6)
                for kind, subject in (("model", "embedder"), *((("gpu", "GPU-000-0"),) if name == "page-00000" else ()))
            ),
            batch_size=5000,
        )  # fmt: skip
    return rows[0][0]


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
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="deployment counts, ascending")
    args = parser.parse_args()

    os.environ["GANTRY_LIVE_PORT"] = str(args.port + 1)
    setup_postgres(args.database_url)
    from playwright.sync_api import sync_playwright

    from controlplane.serving import live_argv, web_argv
    from tests.integration.conftest import CHROMIUM, CHROMIUM_ARGS

    base = f"http://127.0.0.1:{args.port}"
    sizes = [int(size) for size in args.sizes.split(",")]
    print(f"{HOSTS} hosts of {GPUS} GPUs, {EVENTS} events in PostgreSQL; deployments grown to "
          f"{', '.join(map(str, sizes))}; headless Chromium at 1280x800, {args.runs} loads each; "
          f"{os.cpu_count()} cores")  # fmt: skip
    lines = []
    for size in sizes:
        started = time.monotonic()
        deployment = _seed(size)
        seeded = time.monotonic() - started
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
            in_view = "document.querySelectorAll('tr[data-deployment]').length"
            drawn = f"{in_view} > 0 && document.querySelectorAll('[data-sparkline][data-points]').length === {in_view}"
            floor = _measure(page, f"{base}/healthz", "document.readyState !== 'loading'", args.runs)
            events = _measure(page, f"{base}/events/", "document.readyState === 'complete'", args.runs)
            dashboard = _measure(
                page, f"{base}/",
                f"{live} && {drawn}",
                args.runs,
            )  # fmt: skip
            html = len(page.content().encode())
            detail = None
            if size == sizes[0]:
                detail = _measure(
                    page, f"{base}/deployments/{deployment}/",
                    f"{live} && Number(document.querySelector('figure[data-chart=request_rate]')"
                    "?.dataset.points) > 300",
                    args.runs,
                )  # fmt: skip
            browser.close()
        lines.append(f"\n{size} deployments (seeded in {seeded:.0f} s); dashboard HTML {html / 1000:.0f} kB")
        lines.append(_line("events page (100 rows, nothing live)", events, floor))
        lines.append(_line("dashboard (a page of 50 rows, 20 hosts' GPUs)", dashboard, floor))
        if detail is not None:
            lines.append(_line("deployment page (an hour of charts, timeline)", detail, floor))
        print("\n".join(lines[-(4 if detail is not None else 3) :]), flush=True)
    print("  floor: the same browser opening /healthz; target: each page under 1000 ms at every size")


if __name__ == "__main__":
    main()
