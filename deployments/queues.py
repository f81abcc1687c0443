"""Where work for a GPU host travels, and the one way to send it.

Every task Gantry enqueues is named here, and every enqueue goes through
``enqueue_on_commit``: the row that asks for the work is committed first, so a
worker never picks up a task for a row it cannot see yet. The Celery app is
looked up as Celery's current app (controlplane.celery sets it), so this
package never imports the project package above it.
"""

from __future__ import annotations

from typing import Any

from celery import current_app
from django.db import transaction

# Task names: the worker registers them in workers.tasks under these names.
LAUNCH_DEPLOYMENT = "workers.tasks.launch_deployment"
STOP_DEPLOYMENT = "workers.tasks.stop_deployment"
APPLY_GENERATION = "workers.tasks.apply_generation"
INSPECT_MODEL = "workers.tasks.inspect_model"
RUN_BUILD = "workers.tasks.run_build"
# Remove what a deleted deployment or build left on its host's disk.
FORGET_DEPLOYMENT = "workers.tasks.forget_deployment"
FORGET_BUILD = "workers.tasks.forget_build"
# The control plane's periodic work (its beat runs it on queue "control", see settings).
SWEEP_HOSTS = "deployments.tasks.sweep_hosts"


def host_queue(host_name: str) -> str:
    """The queue a GPU host's worker consumes (and nothing else does)."""
    return f"gpu.{host_name}"


def enqueue_on_commit(task_name: str, *, host_name: str, args: list[Any]) -> None:
    """Send ``task_name(*args)`` to ``host_name``'s worker once the current transaction commits."""
    queue = host_queue(host_name)
    transaction.on_commit(lambda: current_app.send_task(task_name, args=args, queue=queue))
