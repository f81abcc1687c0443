"""The outbox: a task is committed with the change that asks for it, sent to
its host's queue once committed, and waits (visibly) while the broker is down."""

from __future__ import annotations

from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core import queues
from core.models import Event
from deployments.services import deployments, replicas
from deployments.services.placements import PlacementSpec
from hosts import outbox
from hosts.models import OutboxMessage
from tests import factories


class Broker:
    """Celery's send_task, at its seam: takes messages, or refuses them while down."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list, str]] = []
        self.down = False

    def send_task(self, name: str, *, args: list, queue: str, retry: bool, headers: dict) -> None:
        if self.down:
            raise ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        assert isinstance(headers[outbox.SENT_AT_HEADER], float)  # the queue's task age on /metrics
        self.sent.append((name, args, queue))


@pytest.fixture
def broker(monkeypatch):  # noqa: ANN001, ANN201
    fake = Broker()
    monkeypatch.setattr(outbox, "current_app", fake)
    return fake


@pytest.fixture
def handed(monkeypatch):  # noqa: ANN001, ANN201 - what reaches the sender thread
    ids: list[int] = []
    monkeypatch.setattr(outbox, "send_soon", ids.append)
    return ids


def test_a_task_is_written_with_the_change_and_handed_to_the_sender_on_commit(
    db, broker, handed, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        with transaction.atomic():
            message = outbox.enqueue_on_commit(queues.LAUNCH_REPLICA, host_name="gpu-2", args=[7])
            assert handed == []
    assert handed == [message.pk]
    assert outbox.send(ids=handed) == 1
    assert broker.sent == [("workers.tasks.launch_replica", [7], "gpu.gpu-2")]
    assert not OutboxMessage.objects.exists()


def test_a_rolled_back_change_leaves_no_task(db, broker, handed, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        with pytest.raises(RuntimeError), transaction.atomic():
            outbox.enqueue_on_commit(queues.STOP_REPLICA, host_name="gpu-2", args=[7])
            raise RuntimeError("the service refused after all")
    assert handed == []
    assert not OutboxMessage.objects.exists()


def _started(minilm, operator):  # noqa: ANN001, ANN202
    OutboxMessage.objects.all().delete()  # the model's inspection: not what these tests are about
    factories.surveyed()
    deployment = deployments.deployment_create(
        name="web", hosts=[minilm.host.name], placements=[PlacementSpec(model="minilm")], user=operator
    )
    return deployments.deployment_start(deployment_id=deployment.pk, user=operator)


def test_a_task_waits_while_the_broker_is_down_and_the_timeline_says_so(db, broker, handed, minilm, operator):
    deployment = _started(minilm, operator)
    broker.down = True
    assert outbox.send() == 0
    assert outbox.send() == 0
    message = OutboxMessage.objects.get()
    assert (message.attempts, message.task) == (2, queues.LAUNCH_REPLICA)
    assert "Connection refused" in message.last_error
    waiting = Event.objects.filter(deployment=deployment, kind="task.waiting")
    assert waiting.count() == 1  # said once, not at every attempt
    assert "launch replica task waits in the outbox" in waiting.get().message

    OutboxMessage.objects.update(created_at=timezone.now() - timedelta(seconds=42))
    broker.down = False
    assert outbox.relay(host_name=minilm.host.name) == 1
    replica = factories.replica_of(deployment)
    assert broker.sent == [(queues.LAUNCH_REPLICA, [replica.pk], queues.host_queue(minilm.host.name))]
    late = Event.objects.get(deployment=deployment, kind="task.redriven")
    assert late.data["waited_s"] >= 42
    assert "42s after it was asked for" in late.message


def test_relay_sends_oldest_first_and_stops_at_the_first_refusal(db, broker, handed):
    for deployment_id in (1, 2, 3):
        outbox.enqueue_on_commit(queues.STOP_REPLICA, host_name="gpu-2", args=[deployment_id])
    assert outbox.relay() == 3
    assert [args for _, args, _ in broker.sent] == [[1], [2], [3]]


def test_a_redrive_is_skipped_while_the_first_task_still_waits(db, broker, handed, minilm, operator):
    deployment = _started(minilm, operator)
    replica = factories.replica_of(deployment)
    assert not replicas.replica_redrive(replica_id=replica.pk, source="test", message="lost?")
    outbox.send()
    assert replicas.replica_redrive(replica_id=replica.pk, source="test", message="lost!")
    assert OutboxMessage.objects.get().args == [replica.pk]
    assert Event.objects.filter(deployment=deployment, kind="task.redriven").count() == 1


def test_every_task_name_is_registered_by_the_worker():
    from celery import current_app

    import workers.tasks  # noqa: F401 - registers the tasks

    names = [queues.LAUNCH_REPLICA, queues.STOP_REPLICA, queues.APPLY_GENERATION, queues.INSPECT_MODEL]
    assert set(names + [queues.RUN_BUILD, queues.FORGET_BUILD, queues.FORGET_DEPLOYMENT]) <= set(current_app.tasks)


def test_an_updating_deployment_is_redriven_with_its_generation(db, broker, handed, minilm, operator):

    deployment = _started(minilm, operator)
    factories.deployment_in(deployment, "loading", "ready")
    deployments.deployment_change(
        deployment_id=deployment.pk, placements=[PlacementSpec(model="minilm", max_batch_size=8)], user=operator
    )
    OutboxMessage.objects.all().delete()  # sent, then lost
    replica = factories.replica_of(deployment)
    assert replicas.replica_redrive(replica_id=replica.pk, source="test", message="lost")
    message = OutboxMessage.objects.get()
    assert (message.task, message.args) == (queues.APPLY_GENERATION, [replica.pk, 2])


@pytest.fixture
def strict_redis():  # noqa: ANN201 - the test Redis, refusing any bulk string over 1 MB for a while
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    before = client.config_get("proto-max-bulk-len")["proto-max-bulk-len"]
    client.config_set("proto-max-bulk-len", str(2**20))
    try:
        yield client
    finally:
        client.config_set("proto-max-bulk-len", before)
        client.delete("gpu.poison-host")


def test_a_message_the_answering_broker_refuses_is_parked_and_never_blocks_its_queue(db, strict_redis):
    """A real Redis that answers pings but refuses one message (its body is over the
    server's bulk limit): the messages behind it are sent, and it is parked after
    PARK_AFTER passes with the cause on the timeline."""
    host = "poison-host"
    poisoned = OutboxMessage.objects.create(
        task=queues.LAUNCH_REPLICA, queue=queues.host_queue(host), args=[1, "x" * 2 * 2**20]
    )
    behind = OutboxMessage.objects.create(task=queues.STOP_REPLICA, queue=queues.host_queue(host), args=[2])
    assert outbox.send(host_name=host) == 1  # the one behind it went
    assert not OutboxMessage.objects.filter(pk=behind.pk).exists()
    assert strict_redis.llen("gpu.poison-host") == 1
    for _ in range(outbox.PARK_AFTER - 1):
        assert outbox.send(host_name=host) == 0
    poisoned.refresh_from_db()
    assert poisoned.parked_at is not None and poisoned.attempts == outbox.PARK_AFTER
    assert "OperationalError" in poisoned.last_error
    parked = Event.objects.get(kind="task.parked")
    assert f"parked in the outbox (message {poisoned.pk})" in parked.message
    assert outbox.send(host_name=host) == 0  # never tried again
    poisoned.refresh_from_db()
    assert poisoned.attempts == outbox.PARK_AFTER
    assert not outbox.is_waiting(queues.LAUNCH_REPLICA, 1)  # a re-drive may send it anew


def test_every_task_a_row_waits_for_is_registered_once_and_sent_again_after_a_broker_restart():
    host_tasks = {
        value
        for name, value in vars(queues).items()
        if name.isupper() and isinstance(value, str) and value.startswith("workers.tasks.")
    }
    # Clean-ups: no row waits for them (a removal lost with the broker is asked again).
    nothing_waits = {queues.FORGET_DEPLOYMENT, queues.FORGET_BUILD, queues.REMOVE_COPY}
    assert set(outbox.TASKS) == host_tasks - nothing_waits
    resent = {name for name, task in outbox.TASKS.items() if task.resend_waiting is not None}
    # A replica's launch resends its stop and apply too (its status says which it waits for).
    assert resent == host_tasks - nothing_waits - {queues.STOP_REPLICA, queues.APPLY_GENERATION}
    with pytest.raises(ValueError, match="registered twice"):
        outbox.register(outbox.HostTask(queues.RUN_BUILD))
