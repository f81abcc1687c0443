"""The host agent: runs inside the worker that consumes this host's queue.

On start and then every GANTRY_HEARTBEAT_INTERVAL seconds it reports the
host's name, address and GPU inventory (NVML), keeps the host's channel
certificate (workers.channel), sends what waits in the outbox
for this host (workers.broker), and reconciles the host's deployments with the
servers that really run here; between beats it checks every second that the
servers it shows as serving still run. A second thread records which
registered checkpoints this host's disk holds (workers.deploy.copies). None
of it needs the broker: the database is the source of truth, so the agent
keeps converging through a broker outage, and says on the host's timeline
when it lost and regained the broker or the database.
"""

from __future__ import annotations

import logging
import threading
import time

from celery.signals import task_postrun, worker_ready, worker_shutdown
from django.conf import settings
from django.db import close_old_connections

from common import metrics
from core.queues import host_queue
from hosts.services import hosts
from workers import broker, channel, exporter, hubfiles, nvml
from workers.deploy import copies
from workers.deploy import reconcile as deploy_reconcile
from workers.engines import executors
from workers.engines import reconcile as build_reconcile
from workers.jobs import source
from workers.loadtest import runs as loadtest_runs
from workers.loadtest import tuning as loadtest_tuning

log = logging.getLogger(__name__)
AGENT_VERSION = "0.1.0"
_stop = threading.Event()


# Between beats, how often serving deployments' servers are checked for a crash.
WATCH_EVERY_S = 1.0
# Probing images and the native toolchain takes a moment: refreshed every few beats.
BUILDERS_EVERY_BEATS = 6
_beats = 0
_builders: dict = {}
_broker = broker.BrokerWatch()
_adopted = False
_metrics_server = None  # the host's /metrics (workers.exporter), started with the agent


def beat_once() -> None:
    """One heartbeat with the current inventory, then one reconcile pass."""
    global _beats, _builders, _adopted
    inventory = nvml.read_inventory()
    if _beats % BUILDERS_EVERY_BEATS == 0:
        _builders = executors.builders_report()
    _beats += 1
    host = hosts.host_heartbeat(
        name=settings.GANTRY_HOST_NAME,
        address=settings.GANTRY_HOST_ADDRESS,
        driver_version=inventory.driver_version,
        cuda_version=inventory.cuda_version,
        nvml_error=inventory.error,
        agent_version=AGENT_VERSION,
        gpus=inventory.gpus,
        builders=_builders,
    )
    channel.keep_certificate(host.pk)
    channel.ensure_running()
    if not _adopted:
        # A task the previous worker was running died with it, and Redis hands its
        # message back only after the visibility timeout: send those again now.
        broker.redrive_host(
            host_name=settings.GANTRY_HOST_NAME,
            source=source(),
            reason="this host's worker started, and tasks its predecessor was running may have died with it",
        )
        deploy_reconcile.adopt_servers()
        _adopted = True
    _broker.beat()
    exporter.keep_gpus(inventory.gpus)
    deploy_reconcile.reconcile_host(inventory)
    deploy_reconcile.relaunch_failed()
    build_reconcile.reconcile_builds()
    loadtest_runs.reconcile_runs()
    loadtest_tuning.reconcile_runs()


def run_forever() -> None:
    failing_since: float | None = None
    while not _stop.is_set():
        close_old_connections()
        try:
            beat_once()
        except Exception:  # noqa: BLE001 - the agent must outlive a bad beat (database restart, ...)
            log.exception("host agent beat failed")
            failing_since = failing_since or time.monotonic()
        else:
            if failing_since is not None:
                _note_recovery(time.monotonic() - failing_since)
                failing_since = None
        _watch_until(time.monotonic() + settings.GANTRY_HEARTBEAT_INTERVAL)


def _watch_until(deadline: float) -> None:
    """Until the next beat, look for crashed servers every WATCH_EVERY_S."""
    while not _stop.wait(min(WATCH_EVERY_S, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            return
        try:
            deploy_reconcile.watch_crashes()
        except Exception:  # noqa: BLE001 - the next beat says what is wrong (database away, ...)
            log.debug("crash watch failed", exc_info=True)


def _note_recovery(outage_s: float) -> None:
    """After beats failed (the database was unreachable, most often), say so."""
    try:
        hosts.record_host_event(
            host_name=settings.GANTRY_HOST_NAME,
            kind="host.agent_recovered",
            source=source(),
            message=f"this host's beats failed for {outage_s:.0f}s (the worker log says why; most often the "
            "database was unreachable) and succeed again; reconcile has caught up",
        )
    except Exception:  # noqa: BLE001 - the next recovery note is not worth a crash
        log.exception("could not record the agent's recovery")


@worker_ready.connect
def _start_agent(sender, **kwargs) -> None:  # noqa: ANN001
    queues = set(sender.app.amqp.queues.consume_from or {})
    if host_queue(settings.GANTRY_HOST_NAME) not in queues:
        return
    _stop.clear()
    global _metrics_server
    if _metrics_server is None:
        _metrics_server = exporter.serve(settings.GANTRY_HOST_ADDRESS, settings.GANTRY_WORKER_METRICS_PORT)
    threading.Thread(target=run_forever, name="gantry-host-agent", daemon=True).start()
    threading.Thread(target=copies.run_forever, args=(_stop,), name="gantry-checkpoint-survey", daemon=True).start()
    if channel.wanted():
        hubfiles.serve()  # this host's hub cache, for the control plane's relay to other hosts
    log.info("host agent started for %s", settings.GANTRY_HOST_NAME)


@task_postrun.connect
def _count_task(sender=None, state: str | None = None, **kwargs) -> None:  # noqa: ANN001, ANN003
    metrics.count(metrics.WORKER_TASKS, getattr(sender, "name", "unknown"), state or "unknown")


@worker_shutdown.connect
def _stop_agent(**kwargs) -> None:  # noqa: ANN003
    _stop.set()
