"""The Celery application shared by the control plane and the GPU-host workers.

Work for a host travels on its two queues (core.queues); the worker on
that host consumes only those (workers.hostworker; docs/gpu-hosts.md).
"""

import os
from pathlib import Path

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("gantry")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["access", "hosts", "deployments", "workers", "loadtests"])


def host_worker_argv(python: str, host_name: str) -> list[str]:
    """The command line of a GPU host's worker: its control and jobs workers, consuming only that host's queues."""
    return [python, "-m", "workers.hostworker", host_name]


def beat_argv(python: str, schedule: Path) -> list[str]:
    """The command line of the control plane's periodic work: a worker with the
    beat, consuming queue "control" (host sweeps, the outbox relay)."""
    return [
        python,
        "-m",
        "celery",
        "-A",
        "controlplane",
        "worker",
        "--beat",
        "-Q",
        "control",
        "-n",
        "control@gantry",
        "-c",
        "1",
        "-s",
        str(schedule),
        "-l",
        "INFO",
    ]
