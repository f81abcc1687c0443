"""The host's task names: a replica's tasks are named for replicas, and the
names they had in 0.1.0 still run them, for messages queued before an upgrade."""

from __future__ import annotations

from controlplane.celery import app
from core import queues
from workers import tasks


def test_a_message_queued_under_a_replica_tasks_old_name_runs_the_same_work():
    registered = app.tasks
    assert registered[queues.LAUNCH_REPLICA].run is tasks.launch_replica.run
    assert registered["workers.tasks.launch_deployment"].run is tasks.launch_replica.run
    assert registered[queues.STOP_REPLICA].run is tasks.stop_replica.run
    assert registered["workers.tasks.stop_deployment"].run is tasks.stop_replica.run
