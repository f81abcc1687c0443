"""One way to enqueue: after the row commits, on the host's own queue."""

from __future__ import annotations

import pytest
from django.db import transaction

from deployments import queues


class Broker:
    def __init__(self) -> None:
        self.sent: list[tuple[str, list, str]] = []

    def send_task(self, name: str, *, args: list, queue: str) -> None:
        self.sent.append((name, args, queue))


@pytest.fixture
def broker(monkeypatch):  # noqa: ANN001, ANN201 - the Celery seam
    fake = Broker()
    monkeypatch.setattr(queues, "current_app", fake)
    return fake


def test_a_task_is_sent_to_its_host_queue_once_the_transaction_commits(db, broker, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        with transaction.atomic():
            queues.enqueue_on_commit(queues.LAUNCH_DEPLOYMENT, host_name="gpu-2", args=[7])
            assert broker.sent == []
    assert broker.sent == [("workers.tasks.launch_deployment", [7], "gpu.gpu-2")]


def test_a_rolled_back_transaction_sends_nothing(db, broker, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        with pytest.raises(RuntimeError), transaction.atomic():
            queues.enqueue_on_commit(queues.STOP_DEPLOYMENT, host_name="gpu-2", args=[7])
            raise RuntimeError("the service refused after all")
    assert broker.sent == []


def test_every_task_name_is_registered_by_the_worker():
    from celery import current_app

    import workers.tasks  # noqa: F401 - registers the tasks

    names = [queues.LAUNCH_DEPLOYMENT, queues.STOP_DEPLOYMENT, queues.APPLY_GENERATION, queues.INSPECT_MODEL]
    assert set(names + [queues.RUN_BUILD]) <= set(current_app.tasks)
