"""The Celery application shared by the control plane and the GPU-host workers.

Work for a host travels on the queue ``gpu.<host-name>``; a worker on that host
consumes only its own queue (see README: adding a GPU host).
"""

import os

from celery import Celery

from deployments.queues import host_queue

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("gantry")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["deployments", "workers", "loadtests"])


def host_worker_argv(python: str, host_name: str, *, concurrency: int = 2) -> list[str]:
    """The command line of a GPU host's worker: consumes only that host's queue."""
    return [
        python, "-m", "celery", "-A", "controlplane", "worker",
        "-Q", host_queue(host_name), "-n", f"gantry@{host_name}", "-c", str(concurrency), "-l", "INFO",
    ]  # fmt: skip
